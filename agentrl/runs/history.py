"""The run's own metric history: `run_dir/metrics.jsonl`, one JSON line per `Tracker.log` call.

It is what the end-of-run plot reads, and it survives a restart, so a resumed run plots the
whole run without asking MLflow.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def read_metrics_history(run_dir: Path) -> list[dict[str, float | None]]:
    """Read `run_dir/metrics.jsonl` into one record per step, sorted by step.

    Records for the same step are merged, later values winning (a resumed run redoes the steps
    after its last checkpoint). Non-finite values were stored as null and come back as None. A
    torn last line (the process died mid-write) is skipped.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    by_step: dict[int, dict[str, float | None]] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            logger.warning("%s:%d: skipping unreadable metrics line", path, lineno)
            continue
        by_step[step] = {**by_step.get(step, {}), **record}
    return [by_step[s] for s in sorted(by_step)]


def truncate_metrics_history(run_dir: Path, step: int) -> int:
    """Keep only the records of steps <= `step` in `run_dir/metrics.jsonl`, one line per step; returns how many
    lines went (those of later steps, repeats merged into one record, torn or unreadable lines).

    What a resumed run calls with its checkpoint's step before logging again: the steps after the checkpoint
    are redone, so their old records go. The file is rewritten whole and renamed into place (a crash leaves
    the old file or the new one), and only when something changes.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    by_step: dict[int, dict] = {}
    for line in lines:
        try:
            record = json.loads(line)
            record_step = int(record["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        if record_step <= step:
            by_step[record_step] = {**by_step.get(record_step, {}), **record}
    kept = [json.dumps(by_step[s]) for s in sorted(by_step)]
    dropped = len(lines) - len(kept)
    if kept == lines:
        return 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    logger.info(
        "%s: dropped %d records after step %d (the resumed run redoes those steps)", path, dropped, step
    )
    return dropped
