"""A resumed run's history, cut back to its checkpoint: every step appears once in what the run leaves.

A run stopped after step 7 with checkpoints every 4 steps resumes from step 4 and redoes steps 5-7. Without
this, `metrics.jsonl` would hold 0..7, then 5, 6, 7 again; the rollout folder would keep files of steps the
resumed run may never redo (another `trainer.total_training_steps` or `test_freq`); MLflow would show two
values at each redone step. `truncate_run_history(run_dir, step)` removes everything after `step` from all
three, before the resumed run logs anything:

- `metrics.jsonl`: rewritten with the records of steps <= `step`, one line per step, and renamed into place;
- the rollout files (`step_N.jsonl`, `val_step_N.jsonl`) of steps > `step` are deleted;
- the MLflow run named in `mlflow_run_id.txt`: its metric values and episode traces of steps > `step`
  (metric values only in a SQLite store; `agentrl.tracking.mlflow_backend.truncate_mlflow_history`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.runs.history import truncate_metrics_history
from agentrl.runs.rollout_writer import ROLLOUTS_DIR, truncate_rollouts
from agentrl.tracking.mlflow_backend import RUN_ID_FILE, truncate_mlflow_history

logger = logging.getLogger(__name__)


@dataclass
class TruncatedHistory:
    """What `truncate_run_history` removed."""

    step: int
    metrics_records: int = 0
    """Lines of metrics.jsonl dropped (later steps, repeats merged, torn lines)."""
    rollout_files: list[Path] = field(default_factory=list)
    mlflow_metrics: int = 0
    mlflow_traces: int = 0


def truncate_run_history(
    run_dir: str | Path, step: int, rollouts_dir: str | Path | None = None
) -> TruncatedHistory:
    """Cut the history of the run in `run_dir` back to `step` (the checkpoint a run resumes from).

    `rollouts_dir` is `trainer.rollout_data_dir` (None: `run_dir/rollouts`). MLflow is touched (and imported)
    only when the run folder names an MLflow run.
    """
    run_dir = Path(run_dir)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    done = TruncatedHistory(step=step)
    done.metrics_records = truncate_metrics_history(run_dir, step)
    done.rollout_files = truncate_rollouts(Path(rollouts_dir or run_dir / ROLLOUTS_DIR), step)
    if (run_dir / RUN_ID_FILE).exists():  # imports mlflow (about a second) only then
        counts = truncate_mlflow_history(run_dir, step)
        done.mlflow_metrics, done.mlflow_traces = counts["metrics"], counts["traces"]
    if done.metrics_records or done.rollout_files or done.mlflow_metrics or done.mlflow_traces:
        logger.info(
            "resuming at step %d: removed the later history (%d metrics.jsonl lines, %d rollout files, "
            "%d MLflow metric values, %d MLflow traces)",
            step,
            done.metrics_records,
            len(done.rollout_files),
            done.mlflow_metrics,
            done.mlflow_traces,
        )
    return done
