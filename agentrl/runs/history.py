"""The run's own metric history: `run_dir/metrics.jsonl`, one JSON line per `Tracker.log` call.

It is what the end-of-run plot reads, and it survives a restart, so a resumed run plots the
whole run without asking MLflow.
"""

from __future__ import annotations

import json
import logging
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
