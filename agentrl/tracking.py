"""Experiment tracking: one `Tracker` that fans metrics out to console, MLflow and a JSONL history.

The controller calls `tracker.log(metrics, step)` once per training step. Every run also keeps
`{run_dir}/metrics.jsonl` (one line per `log` call) so the end-of-run plot and a resumed run see
the whole history without asking MLflow. MLflow is imported only when the `mlflow` logger is
asked for, because importing it costs about a second and pulls SQLAlchemy.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

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

logger = logging.getLogger(__name__)

ALLOWED_LOGGERS = ("console", "mlflow")
_METRICS_FILE = "metrics.jsonl"
_RUN_ID_FILE = "mlflow_run_id.txt"
# MLflow's own limits (mlflow.utils.validation): keys up to 250 chars, param values up to 6000,
# at most 100 params and 1000 metrics per log_batch call.
_MAX_KEY_LEN = 250
_MAX_PARAM_VALUE_LEN = 6000
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
# MLflow accepts names made of word characters, '/', '.', '-', ' ' and ':' that do not change
# under posix normpath; anything else is rejected by the tracking store.
_MLFLOW_NAME_RE = re.compile(r"^[/\w.\- :]*$")
_TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")


# ----------------------------------------------------------------------------- helpers


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


def _is_valid_mlflow_name(name: str) -> bool:
    norm = os.path.normpath(name) if name else name
    return (
        bool(name)
        and len(name) <= _MAX_KEY_LEN
        and _MLFLOW_NAME_RE.match(name) is not None
        and norm == name
        and not name.startswith(("/", ".."))
    )


def _sanitize_mlflow_name(name: str) -> str:
    """Return `name` unchanged when MLflow accepts it, else a close name that it does accept."""
    if _is_valid_mlflow_name(name):
        return name
    cleaned = re.sub(r"[^/\w.\- :]", "_", name)
    cleaned = re.sub(r"/+", "/", cleaned).strip("/")
    parts = [p if p not in (".", "..") else p.replace(".", "_") for p in cleaned.split("/")]
    cleaned = "/".join(parts)[:_MAX_KEY_LEN].rstrip("/") or "_"
    return cleaned


def _short(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.2e}"
    return f"{value:.4g}"


def format_console_line(metrics: Mapping[str, float], step: int) -> str:
    """One compact line with the numbers people watch: reward, validation, losses, speed, time."""
    parts = [f"step {step}"]
    named = (
        ("reward", "critic/full-score/mean"),
        ("pg_loss", "actor/pg_loss"),
        ("kl_loss", "actor/kl_loss"),
        ("entropy", "actor/entropy"),
        ("resp_len", "response_length/mean"),
        ("tok/s", "perf/throughput"),
    )
    for label, key in named:
        if key in metrics:
            parts.append(f"{label} {_short(metrics[key])}")
    for key in sorted(k for k in metrics if k.startswith("val/")):
        parts.append(f"{key.removeprefix('val/test_score/')} {_short(metrics[key])}")
    timings = sorted(k for k in metrics if k.startswith(("timing/", "timing_s/")))
    if timings:
        parts.append(" ".join(f"{k.split('/', 1)[1]} {_short(metrics[k])}s" for k in timings))
    return " | ".join(parts)


# ----------------------------------------------------------------------------- backends


class _ConsoleBackend:
    """Prints one line per step to stdout, through tqdm so that open progress bars stay intact."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        tqdm.write(format_console_line(metrics, step), file=sys.stdout)

    def log_params(self, params: Mapping[str, str]) -> None:
        pass

    def log_artifact(self, path: Path) -> None:
        pass

    def finish(self, status: str) -> None:
        pass


def _silence_mlflow_logging() -> None:
    # Creating a SQLite store runs alembic migrations that log a dozen INFO lines per run.
    for name in ("alembic", "mlflow.store", "mlflow.tracking", "mlflow.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)


class _MlflowBackend:
    """Logs to one MLflow run; on a resumed run (same run_dir) it reopens the run it logged to."""

    def __init__(self, *, run_dir: Path, project_name: str, experiment_name: str) -> None:
        _silence_mlflow_logging()
        from mlflow.tracking import MlflowClient

        env_uri = os.environ.get("MLFLOW_TRACKING_URI")
        self.tracking_uri = env_uri or f"sqlite:///{run_dir.resolve()}/mlflow.db"
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self._skipped: Counter[str] = Counter()
        self._renamed: dict[str, str] = {}
        self._logged_params: dict[str, str] = {}
        self._finished = False

        experiment = self._client.get_experiment_by_name(project_name)
        if experiment is None:
            # A shared tracking server chooses its own artifact store; a local one keeps them here.
            location = None if env_uri else (run_dir.resolve() / "mlartifacts").as_uri()
            experiment_id = self._client.create_experiment(project_name, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id

        id_file = run_dir / _RUN_ID_FILE
        self.run_id = self._reopen_run(id_file, experiment_id)
        if self.run_id is None:
            run = self._client.create_run(experiment_id, run_name=experiment_name)
            self.run_id = run.info.run_id
            id_file.write_text(self.run_id + "\n")

    def _reopen_run(self, id_file: Path, experiment_id: str) -> str | None:
        if not id_file.exists():
            return None
        run_id = id_file.read_text().strip()
        try:
            run = self._client.get_run(run_id)
        except Exception as err:  # the store does not know it (another tracking URI, deleted db)
            logger.warning("MLflow run %s from %s not found (%s); starting a new run", run_id, id_file, err)
            return None
        if run.info.experiment_id != experiment_id or run.info.lifecycle_stage != "active":
            logger.warning(
                "MLflow run %s is not an active run of this experiment; starting a new run", run_id
            )
            return None
        self._client.update_run(run_id, status="RUNNING")
        self._logged_params = dict(run.data.params)
        return run_id

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = _now_ms()
        batch = []
        for key, value in metrics.items():
            if not math.isfinite(value):
                if self._skipped[key] == 0:
                    logger.warning(
                        "MLflow: skipping non-finite value %r of metric %r (step %d)", value, key, step
                    )
                self._skipped[key] += 1
                continue
            batch.append(Metric(self._mlflow_key(key), value, now_ms, step))
        for i in range(0, len(batch), _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i : i + _METRICS_PER_BATCH])

    def _mlflow_key(self, key: str) -> str:
        if key not in self._renamed:
            safe = _sanitize_mlflow_name(key)
            if safe != key:
                logger.warning("MLflow rejects metric name %r; logging it as %r", key, safe)
            self._renamed[key] = safe
        return self._renamed[key]

    def log_params(self, params: Mapping[str, str]) -> None:
        """Log params once; on a resumed run, keep the first values (MLflow forbids changing them)."""
        from mlflow.entities import Param

        new, changed = [], []
        for key, value in params.items():
            key = _sanitize_mlflow_name(key)
            if len(value) > _MAX_PARAM_VALUE_LEN:
                value = value[: _MAX_PARAM_VALUE_LEN - 14] + "...(truncated)"
            if key not in self._logged_params:
                new.append(Param(key, value))
                self._logged_params[key] = value
            elif self._logged_params[key] != value:
                changed.append(key)
        if changed:
            logger.warning("MLflow run %s keeps its first values of params %s", self.run_id, sorted(changed))
        for i in range(0, len(new), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=new[i : i + _PARAMS_PER_BATCH])

    def log_artifact(self, path: Path) -> None:
        self._client.log_artifact(self.run_id, str(path))

    def finish(self, status: str) -> None:
        if self._finished:
            return
        self._finished = True
        if self._skipped:
            logger.warning("MLflow: skipped non-finite metric values: %s", dict(self._skipped))
        self._client.set_terminated(self.run_id, status=status)

    @property
    def skipped_non_finite(self) -> dict[str, int]:
        return dict(self._skipped)


def _now_ms() -> int:
    return int(time.time() * 1000)


# ----------------------------------------------------------------------------- tracker


class Tracker:
    """Sends each step's metrics to every backend and appends them to `run_dir/metrics.jsonl`.

    Use as a context manager: leaving the block normally finishes the run as FINISHED, an
    exception as FAILED, Ctrl-C as KILLED.
    """

    def __init__(self, run_dir: Path, backends: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.backends = backends
        self._history_path = run_dir / _METRICS_FILE
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
        record: dict[str, float | None] = {"step": step}
        record.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
        with self._history_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        # A step logged twice (a resumed run redoing steps after its checkpoint) keeps the later
        # record, merged so that validation logged separately from training stays in one record.
        self._history[step] = {**self._history.get(step, {}), **record}
        for backend in self.backends.values():
            backend.log(values, step)

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
) -> Tracker:
    """Build the tracker for `trainer.logger` and log the config as params once.

    A second call with the same `run_dir` (a resumed run) continues the same MLflow run and the
    same `metrics.jsonl`, so step numbers carry on where they stopped.
    """
    unknown = [name for name in loggers if name not in ALLOWED_LOGGERS]
    if unknown:
        raise ValueError(
            f"trainer.logger: unknown logger(s) {unknown}; allowed values are {list(ALLOWED_LOGGERS)}"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    backends: dict[str, Any] = {}
    for name in dict.fromkeys(loggers):
        if name == "console":
            backends[name] = _ConsoleBackend()
        elif name == "mlflow":
            backends[name] = _MlflowBackend(
                run_dir=run_dir, project_name=project_name, experiment_name=experiment_name
            )
    tracker = Tracker(run_dir, backends)
    tracker.log_params_once(config)
    return tracker


def read_metrics_history(run_dir: Path) -> list[dict[str, float | None]]:
    """Read `run_dir/metrics.jsonl` into one record per step, sorted by step.

    Records for the same step are merged, later values winning (a resumed run redoes the steps
    after its last checkpoint). Non-finite values were stored as null and come back as None. A
    torn last line (the process died mid-write) is skipped.
    """
    path = Path(run_dir) / _METRICS_FILE
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


# ----------------------------------------------------------------------------- progress


def progress_bar(desc: str, total: int, *, leave: bool = False) -> tqdm:
    """A tqdm bar on stderr for rollout, update and validation phases.

    Shown when stderr is a terminal; `AGENTRL_PROGRESS=1` forces it on (logs, CI), `=0` off.
    Callers report progress with `bar.update(n)` and the numbers with `set_progress_postfix`.
    """
    flag = os.environ.get("AGENTRL_PROGRESS", "").strip().lower()
    if flag in ("1", "true", "yes", "on"):
        disable = False
    elif flag in ("0", "false", "no", "off"):
        disable = True
    else:
        disable = not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=disable, leave=leave, dynamic_ncols=True)


def set_progress_postfix(
    bar: tqdm, *, step: int, reward: float | None = None, throughput: float | None = None
) -> None:
    """Show `step`, `reward` and `tok/s` (in that order) after the bar, via `bar.set_postfix`."""
    stats: dict[str, str] = {"step": str(step)}
    if reward is not None:
        stats["reward"] = _short(float(reward))
    if throughput is not None:
        stats["tok/s"] = f"{float(throughput):.0f}"
    bar.set_postfix(stats)
