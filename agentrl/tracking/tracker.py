"""The `Tracker`: fans each step's metrics out to the chosen backends and the JSONL history."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentrl.runs.history import METRICS_FILE, read_metrics_history
from agentrl.tracking.console import ConsoleBackend

ALLOWED_LOGGERS = ("console", "mlflow")
_TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")


def flatten_config(config: Mapping[str, Any] | Any, prefix: str = "") -> dict[str, str]:
    """Flatten a nested config into dotted keys with string values (the form MLflow params take).

    Accepts a plain mapping or anything with `model_dump()` (the pydantic config). Lists stay one
    value (`"['console', 'mlflow']"`) because their positions are not separate settings.
    """
    if hasattr(config, "model_dump"):
        config = config.model_dump()
    flat: dict[str, str] = {}
    for key, value in config.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if hasattr(value, "model_dump"):
            value = value.model_dump()
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, dotted))
        else:
            flat[dotted] = str(value)
    return flat


def _to_float(key: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(
            f"metric {key!r} has value {value!r} of type {type(value).__name__}; metrics must be numbers"
        ) from err


class Tracker:
    """Sends each step's metrics to every backend and appends them to `run_dir/metrics.jsonl`.

    Use as a context manager: leaving the block normally finishes the run as FINISHED, an
    exception as FAILED, Ctrl-C as KILLED.
    """

    def __init__(self, run_dir: Path, backends: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.backends = backends
        self._history_path = run_dir / METRICS_FILE
        self._history: dict[int, dict[str, float | None]] = {
            int(rec["step"]): rec for rec in read_metrics_history(run_dir)
        }
        self._params_logged = False
        self.finished_status: str | None = None

    @property
    def mlflow_run_id(self) -> str | None:
        backend = self.backends.get("mlflow")
        return backend.run_id if backend is not None else None

    @property
    def history(self) -> list[dict[str, float | None]]:
        """Every logged step so far (this process and earlier ones of a resumed run), by step."""
        return [self._history[s] for s in sorted(self._history)]

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step. Values must be numbers (0-d tensors are fine); `step` is the global step."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        values = {key: _to_float(key, value) for key, value in metrics.items()}
        record: dict[str, float | None] = {k: (v if math.isfinite(v) else None) for k, v in values.items()}
        record = {"step": step, **{k: v for k, v in record.items() if k != "step"}}
        with self._history_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        # A step logged twice (a resumed run redoing steps after its checkpoint) keeps the later
        # record, merged so that validation logged separately from training stays in one record.
        self._history[step] = {**self._history.get(step, {}), **record}
        for backend in self.backends.values():
            backend.log(values, step)

    def log_rollouts(self, records: list[dict[str, Any]], step: int) -> None:
        """Hand one step's saved episodes (agentrl.runs.rollout_writer records) to backends that show them."""
        for backend in self.backends.values():
            backend.log_rollouts(records, step)

    def log_params_once(self, config: Mapping[str, Any] | Any) -> None:
        """Log the flattened config as params; later calls in this process do nothing."""
        if self._params_logged:
            return
        self._params_logged = True
        params = flatten_config(config)
        for backend in self.backends.values():
            backend.log_params(params)

    def log_artifact(self, path: Path) -> None:
        """Attach a file (e.g. the training-curves PNG) to the run where the backend keeps files."""
        for backend in self.backends.values():
            backend.log_artifact(Path(path))

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with FINISHED, FAILED or KILLED; calling it again does nothing."""
        if status not in _TERMINAL_STATUSES:
            raise ValueError(f"finish status must be one of {_TERMINAL_STATUSES}, got {status!r}")
        if self.finished_status is not None:
            return
        self.finished_status = status
        for backend in self.backends.values():
            backend.finish(status)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.finish("KILLED")
        else:
            self.finish("FAILED")


def build_tracker(
    loggers: list[str],
    *,
    run_dir: Path,
    project_name: str,
    experiment_name: str,
    config: Mapping[str, Any] | Any,
    resume: bool = True,
) -> Tracker:
    """Build the tracker for `trainer.logger` and log the config as params once.

    With `resume=True` (the default) a second call with the same `run_dir` continues the MLflow
    run recorded in `run_dir/mlflow_run_id.txt` and the same `metrics.jsonl`, so a resumed run's
    step numbers carry on where they stopped. Pass `resume=False` when training starts again
    from step 0 (`trainer.resume_mode=disable`, or no checkpoint found): a new MLflow run is
    created and an old `metrics.jsonl` is moved aside to `metrics.<unix time>.jsonl`.
    """
    unknown = [name for name in loggers if name not in ALLOWED_LOGGERS]
    if unknown:
        raise ValueError(
            f"trainer.logger: unknown logger(s) {unknown}; allowed values are {list(ALLOWED_LOGGERS)}"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    old_history = run_dir / METRICS_FILE
    if not resume and old_history.exists():
        old_history.rename(run_dir / f"metrics.{int(time.time())}.jsonl")
    backends: dict[str, Any] = {}
    for name in dict.fromkeys(loggers):
        if name == "console":
            backends[name] = ConsoleBackend()
        elif name == "mlflow":
            from agentrl.tracking.mlflow_backend import MlflowBackend  # lazy: mlflow is slow to import

            backends[name] = MlflowBackend(
                run_dir=run_dir, project_name=project_name, experiment_name=experiment_name, resume=resume
            )
    tracker = Tracker(run_dir, backends)
    tracker.log_params_once(config)
    return tracker
