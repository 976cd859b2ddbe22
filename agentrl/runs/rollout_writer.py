"""Saves every step's episodes to the run folder, one JSONL file per step, so a user can see what was trained on.

`<trainer.rollout_data_dir>/step_000003.jsonl` holds step 3's training episodes (kept and filtered alike),
`val_step_000003.jsonl` the validation run after it; each line is one episode in the versioned format that
docs/rollouts.md describes (`FORMAT_VERSION`). Files are written whole and renamed, so a crash leaves no
half file; a resumed run first deletes the files of steps after its checkpoint (`truncate_rollouts`), then
writes them again as it redoes those steps. Which episodes are saved under
`trainer.rollout_data_fraction` < 1 depends only on the episode id and the step, never on an RNG that
training draws from (resume stays exact).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentrl.types import Episode, Step, Trajectory

FORMAT_VERSION = 1
"""Bumped when a field changes meaning or goes away; new fields may appear without a bump."""
ROLLOUTS_DIR = "rollouts"
"""The folder under the run folder used when `trainer.rollout_data_dir` is null."""
_DATA_URL_KEEP = 64
"""Characters kept of an inline `data:` URL (an image); the rest would bloat every step's file."""
_STEP_FILE = re.compile(r"^(?:val_)?step_(?P<step>\d+)\.jsonl$")


def rollout_file_name(step: int, split: str) -> str:
    """`step_000003.jsonl` for training episodes, `val_step_000003.jsonl` for validation."""
    return f"{'val_' if split == 'val' else ''}step_{step:06d}.jsonl"


def truncate_rollouts(folder: Path, step: int) -> list[Path]:
    """Delete the rollout files (train and val) of steps after `step` in `folder`, and leftover temporary files
    of an interrupted write; returns what was deleted. A resumed run calls it with its checkpoint's step, so
    every saved step is one the run's history holds (each file holds one step, so no file is rewritten)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    doomed = list(folder.glob("*step_*.jsonl.tmp"))
    for path in folder.glob("*step_*.jsonl"):
        match = _STEP_FILE.match(path.name)
        if match and int(match["step"]) > step:
            doomed.append(path)
    for path in doomed:
        path.unlink(missing_ok=True)
    return sorted(doomed)


def config_hash(config: Any) -> str:
    """A short digest of the resolved config (pydantic model or mapping): records of one setting share it."""
    data = config.model_dump(mode="json") if hasattr(config, "model_dump") else config
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def is_sampled(episode_id: str, step: int, split: str, fraction: float) -> bool:
    """Whether an episode is saved under `fraction`: a hash of (split, step, id) mapped to [0, 1)."""
    if fraction >= 1.0:
        return True
    digest = hashlib.sha256(f"{split}/{step}/{episode_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


class RolloutLog:
    """Writes one step's episodes to `folder`; on every `trace_freq`-th step and on `last_step` it also hands
    the first `trace_max_episodes` of the same records (-1: all) to `on_records` (MLflow traces, which cost
    about 60 ms of CPU per episode to store: all of `make train`'s traced steps took it from 140 to 258 s)."""

    def __init__(
        self,
        folder: Path,
        *,
        fraction: float,
        config_digest: str,
        on_records: Callable[[list[dict[str, Any]], int], None] | None = None,
        trace_freq: int = 1,
        trace_max_episodes: int = -1,
        last_step: int | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.fraction = fraction
        self.config_digest = config_digest
        self.on_records = on_records
        self.trace_freq = trace_freq
        self.trace_max_episodes = trace_max_episodes
        self.last_step = last_step

    def is_traced(self, step: int) -> bool:
        """Whether `step`'s records (validation at that step included; step 0 counts) go to `on_records`."""
        return self.trace_freq > 0 and (step % self.trace_freq == 0 or step == self.last_step)

    @property
    def enabled(self) -> bool:
        return self.fraction > 0.0

    def write(self, step: int, episodes: Sequence[Episode], split: str = "train") -> Path | None:
        """Save the sampled episodes of `step` (`split` is train or val); returns the file, None if none saved."""
        if not self.enabled:
            return None
        records = [
            episode_record(e, step=step, split=split, config_digest=self.config_digest)
            for e in episodes
            if is_sampled(e.id, step, split, self.fraction)
        ]
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / rollout_file_name(step, split)
        tmp = path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        os.replace(tmp, path)
        if self.on_records is not None and records and self.is_traced(step):
            traced = records if self.trace_max_episodes < 0 else records[: self.trace_max_episodes]
            self.on_records(traced, step)
        return path


def episode_record(episode: Episode, *, step: int, split: str, config_digest: str) -> dict[str, Any]:
    """One episode as a JSON-ready dict in format `FORMAT_VERSION` (field table in docs/rollouts.md)."""
    steps = [s for t in episode.trajectories for s in t.steps]
    advantages = [s.advantage for s in steps if s.advantage is not None]
    versions = [s.info["policy_version"] for s in steps if "policy_version" in s.info]
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "split": split,
        "episode_id": episode.id,
        "task_id": episode.task_id,
        "data_source": episode.task.get("data_source"),
        "config_hash": config_digest,
        "reward": episode.reward,
        "is_correct": episode.is_correct,
        "advantage": sum(advantages) / len(advantages) if advantages else None,
        "termination_reason": episode.termination_reason.value,
        "filtered": episode.filter_reason is not None,
        "filter_reason": episode.filter_reason,
        "policy_version": min(versions) if versions else None,
        "answer": episode.answer,
        "error": episode.error,
        "metrics": episode.metrics,
        "trajectories": [_trajectory_record(t) for t in episode.trajectories],
    }


def _trajectory_record(trajectory: Trajectory) -> dict[str, Any]:
    steps = []
    previous: list[dict[str, Any]] | None = None
    for step in trajectory.steps:
        messages = [_shorten_data_urls(m) for m in step.messages]
        # Only what is new since the previous call: a multi-turn request repeats the whole conversation,
        # and its first new message is the previous reply, which that step already holds.
        extends = previous is not None and messages[: len(previous)] == previous
        new = messages[len(previous) :] if extends else messages
        if extends and new and new[0].get("role") == "assistant":
            new = new[1:]
        steps.append(_step_record(step, new, extends))
        previous = messages
    return {"name": trajectory.name, "reward": trajectory.reward, "steps": steps}


def _step_record(step: Step, new_messages: list[dict[str, Any]], extends: bool) -> dict[str, Any]:
    return {
        "messages": new_messages,
        "continues_previous": extends,
        "response": step.model_response,
        "tool_calls": step.tool_calls,
        "finish_reason": step.finish_reason,
        "policy_version": step.info.get("policy_version"),
        "latency_s": step.info.get("latency_s"),
        "server": step.info.get("server"),
        "reward": step.reward,
        "advantage": step.advantage,
        "excluded": step.info.get("excluded"),
        "prompt_ids": step.prompt_ids,
        "response_ids": step.response_ids,
        "logprobs": step.logprobs,
    }


def assistant_message(step: Step) -> dict[str, Any]:
    """The model's reply of `step` as an OpenAI chat message (what a flow sends back in its next request)."""
    message: dict[str, Any] = {"role": "assistant", "content": step.model_response}
    if step.tool_calls:
        message["tool_calls"] = step.tool_calls
    return message


def _shorten_data_urls(value: Any) -> Any:
    if isinstance(value, str):
        if value.startswith("data:") and len(value) > _DATA_URL_KEEP:
            return f"{value[:_DATA_URL_KEEP]}...({len(value) - _DATA_URL_KEEP} characters not saved)"
        return value
    if isinstance(value, dict):
        return {k: _shorten_data_urls(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shorten_data_urls(v) for v in value]
    return value
