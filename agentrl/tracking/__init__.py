"""Experiment tracking: console and MLflow behind one `Tracker`, a JSONL history, progress bars.

The controller builds one tracker with `build_tracker(cfg.trainer.logger, ...)`, calls
`tracker.log(metrics, step)` once per step and `tracker.finish()` (or uses it as a context
manager). MLflow is imported only when the `mlflow` logger is asked for.
"""

from agentrl.runs.history import read_metrics_history
from agentrl.tracking.console import format_console_line
from agentrl.tracking.progress import progress_bar, set_progress_postfix
from agentrl.tracking.tracker import ALLOWED_LOGGERS, Tracker, build_tracker, flatten_config

__all__ = [
    "ALLOWED_LOGGERS",
    "Tracker",
    "build_tracker",
    "flatten_config",
    "format_console_line",
    "progress_bar",
    "read_metrics_history",
    "set_progress_postfix",
]
