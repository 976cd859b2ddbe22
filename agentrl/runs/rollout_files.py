"""Reads the rollout files a run saved (format in docs/rollouts.md): as dicts, or as a pandas DataFrame.

    from agentrl import load_rollouts
    df = load_rollouts("outputs/agentrl/arithmetic")            # one row per episode, every step
    df.groupby("step").reward.mean()

A run folder is enough: its rollouts live in `rollouts/` unless its `config.yaml` names another
`trainer.rollout_data_dir`; the rollouts folder itself is accepted too. Needs neither torch nor a GPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from agentrl.runs.rollout_writer import FORMAT_VERSION, ROLLOUTS_DIR, rollout_file_name

_FILE = re.compile(r"^(?P<val>val_)?step_(?P<step>\d+)\.jsonl$")


class RolloutFilesError(ValueError):
    """A run folder without rollout files, or a step or episode it does not hold."""


def find_rollouts_dir(run_dir: str | Path) -> Path:
    """The folder holding `step_*.jsonl` for `run_dir` (a run folder or the rollouts folder itself)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RolloutFilesError(f"{run_dir}: no such folder (pass a run folder, trainer.default_local_dir)")
    if _step_files(run_dir):
        return run_dir
    configured = _configured_dir(run_dir / "config.yaml")
    for candidate in (configured, run_dir / ROLLOUTS_DIR):
        if candidate is not None and candidate.is_dir() and _step_files(candidate):
            return candidate
    raise RolloutFilesError(
        f"{run_dir}: no rollout files (looked in {configured or run_dir / ROLLOUTS_DIR}); a run saves them "
        "unless trainer.rollout_data_fraction=0"
    )


def _configured_dir(config_file: Path) -> Path | None:
    if not config_file.exists():
        return None
    import yaml

    trainer = (yaml.safe_load(config_file.read_text()) or {}).get("trainer") or {}
    folder = trainer.get("rollout_data_dir")
    return Path(folder) if folder else None


def _step_files(folder: Path) -> dict[tuple[str, int], Path]:
    files = {}
    for path in folder.glob("*step_*.jsonl"):
        match = _FILE.match(path.name)
        if match:
            files[("val" if match["val"] else "train", int(match["step"]))] = path
    return files


def rollout_steps(run_dir: str | Path, split: str = "train") -> list[int]:
    """The steps with a rollout file of `split` (train or val), in order."""
    return sorted(step for (s, step) in _step_files(find_rollouts_dir(run_dir)) if s == split)


def read_rollouts(run_dir: str | Path, step: int | None = None, split: str = "train") -> list[dict[str, Any]]:
    """The episode records of one step (the last one when `step` is None), in the order they were saved."""
    folder = find_rollouts_dir(run_dir)
    steps = rollout_steps(folder, split)
    if not steps:
        raise RolloutFilesError(f"{folder}: no {split} rollout files")
    if step is None:
        step = steps[-1]
    path = folder / rollout_file_name(step, split)
    if not path.exists():
        raise RolloutFilesError(f"{folder}: no {split} rollouts of step {step} (saved steps: {_span(steps)})")
    return _read_file(path)


def _read_file(path: Path) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        version = record.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise RolloutFilesError(
                f"{path}:{number}: format_version {version!r}; this agentrl reads up to {FORMAT_VERSION}"
            )
        records.append(record)
    return records


def _span(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}..{steps[-1]} ({len(steps)} files)"


def load_rollouts(run_dir: str | Path, split: str | None = "train"):
    """Every saved episode of `split` (train, val, or None for both) as a pandas DataFrame, one row each.

    Columns are the record's fields (docs/rollouts.md) plus `num_model_calls`, `num_tool_calls` and
    `response_tokens`; `trajectories` keeps the steps (messages, token ids, logprobs) as lists of dicts.
    """
    try:
        import pandas as pd
    except ImportError as err:  # pragma: no cover - pandas comes with mlflow
        raise ImportError("load_rollouts needs pandas: pip install pandas") from err
    folder = find_rollouts_dir(run_dir)
    rows = []
    for (file_split, _step), path in sorted(_step_files(folder).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if split is None or file_split == split:
            rows += [_with_counts(r) for r in _read_file(path)]
    return pd.DataFrame(rows)


def _with_counts(record: dict[str, Any]) -> dict[str, Any]:
    steps = [s for t in record["trajectories"] for s in t["steps"]]
    return {
        **record,
        "num_model_calls": len(steps),
        "num_tool_calls": sum(len(s.get("tool_calls") or []) for s in steps),
        "response_tokens": sum(len(s["response_ids"]) for s in steps),
    }
