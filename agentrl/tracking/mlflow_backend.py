"""MLflow backend: a local SQLite store under the run folder (or MLFLOW_TRACKING_URI), one run
per experiment that a resumed run reopens. `mlflow` is imported only when this backend is built,
because importing it costs about a second and pulls SQLAlchemy.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

RUN_ID_FILE = "mlflow_run_id.txt"
# MLflow's own limits (mlflow.utils.validation): keys up to 250 chars, param values up to 6000,
# at most 100 params and 1000 metrics per log_batch call.
_MAX_KEY_LEN = 250
_MAX_PARAM_VALUE_LEN = 6000
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
# MLflow accepts names made of word characters, '/', '.', '-', ' ' and ':' that do not change
# under posix normpath; anything else is rejected by the tracking store.
_MLFLOW_NAME_RE = re.compile(r"^[/\w.\- :]*$")


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


def _silence_mlflow_logging() -> None:
    # Creating a SQLite store runs alembic migrations that log a dozen INFO lines per run.
    for name in ("alembic", "mlflow.store", "mlflow.tracking", "mlflow.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)


class MlflowBackend:
    """Logs to one MLflow run; on a resumed run (same run_dir) it reopens the run it logged to."""

    def __init__(self, *, run_dir: Path, project_name: str, experiment_name: str, resume: bool) -> None:
        _silence_mlflow_logging()
        from mlflow.tracking import MlflowClient

        env_uri = os.environ.get("MLFLOW_TRACKING_URI")
        self.tracking_uri = env_uri or f"sqlite:///{run_dir.resolve()}/mlflow.db"
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self._skipped: Counter[str] = Counter()
        self._renamed: dict[str, str] = {}
        self._logged_params: dict[str, str] = {}
        self._finished = False
        self._trace_failures = 0
        self._traces = None

        experiment = self._client.get_experiment_by_name(project_name)
        if experiment is None:
            # A shared tracking server chooses its own artifact store; a local one keeps them here.
            location = None if env_uri else (run_dir.resolve() / "mlartifacts").as_uri()
            experiment_id = self._client.create_experiment(project_name, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id
        self.experiment_id = experiment_id

        id_file = run_dir / RUN_ID_FILE
        self.run_id = self._reopen_run(id_file, experiment_id) if resume else None
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

    def log_rollouts(self, records: list[dict], step: int) -> None:
        """One MLflow trace per saved episode; a failure is reported once and never stops training."""
        from agentrl.tracking.mlflow_traces import EpisodeTraceWriter

        try:
            if self._traces is None:
                self._traces = EpisodeTraceWriter(
                    tracking_uri=self.tracking_uri, experiment_id=self.experiment_id, run_id=self.run_id
                )
            self._traces.log(records)
        except Exception as err:  # noqa: BLE001 - traces are a view; the JSONL files hold the episodes
            self._trace_failed(f"step {step}'s episodes", err)

    def _trace_failed(self, what: str, err: Exception) -> None:
        if self._trace_failures == 0:
            logger.warning(
                "MLflow: could not log %s as traces (%r); training goes on and the rollout files are "
                "complete. Later failures are counted, not reported.",
                what,
                err,
            )
        self._trace_failures += 1

    def finish(self, status: str) -> None:
        if self._finished:
            return
        self._finished = True
        if self._traces is not None:
            try:
                self._traces.close()
            except Exception as err:  # noqa: BLE001
                self._trace_failed("the last episodes", err)
        if self._skipped:
            logger.warning("MLflow: skipped non-finite metric values: %s", dict(self._skipped))
        if self._trace_failures > 1:
            logger.warning("MLflow: %d attempts to log episodes as traces failed", self._trace_failures)
        self._client.set_terminated(self.run_id, status=status)

    @property
    def skipped_non_finite(self) -> dict[str, int]:
        return dict(self._skipped)


def _now_ms() -> int:
    return int(time.time() * 1000)


def tracking_uri_of(run_dir: Path) -> str:
    """The tracking URI a run in `run_dir` logs to: `$MLFLOW_TRACKING_URI`, else `run_dir/mlflow.db`."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(run_dir).resolve()}/mlflow.db"


def truncate_mlflow_history(run_dir: Path, step: int) -> dict[str, int]:
    """Remove what the MLflow run of `run_dir` (`mlflow_run_id.txt`) logged for steps after `step`: metric
    values and episode traces. Returns counts: `metrics` (values deleted) and `traces`.

    A resumed run calls it with its checkpoint's step, so the steps it redoes appear once in MLflow too.
    MLflow's API cannot delete metric values, so they are deleted in the store itself, in one transaction,
    when it is a SQLite file (the run folder's `mlflow.db`, or a `sqlite:///` `MLFLOW_TRACKING_URI`); the
    run's latest values are recomputed. Another store (a tracking server) keeps them: the UI then shows two
    values at each redone step, and a warning says so. Traces are deleted through MLflow's API
    (`delete_traces`), on any store. Nothing here stops a run: a failure is a warning.
    """
    id_file = Path(run_dir) / RUN_ID_FILE
    if not id_file.exists():
        return {"metrics": 0, "traces": 0}
    run_id = id_file.read_text().strip()
    uri = tracking_uri_of(run_dir)
    counts = {"metrics": 0, "traces": 0}
    try:
        counts["metrics"] = _delete_sqlite_metrics(uri, run_id, step)
    except Exception as err:  # noqa: BLE001 - a view of the run; metrics.jsonl is the record
        logger.warning(
            "MLflow: could not remove metric values after step %d of run %s (%r)", step, run_id, err
        )
    try:
        counts["traces"] = _delete_traces_after(uri, run_id, step)
    except Exception as err:  # noqa: BLE001
        logger.warning(
            "MLflow: could not remove episode traces after step %d of run %s (%r)", step, run_id, err
        )
    return counts


def _delete_sqlite_metrics(uri: str, run_id: str, step: int) -> int:
    import sqlite3

    if not uri.startswith("sqlite:///"):
        logger.warning(
            "MLflow (%s) keeps the metric values run %s logged after step %d before this resume: its API "
            "cannot delete them, so the redone steps show two values there (metrics.jsonl holds each once)",
            uri,
            run_id,
            step,
        )
        return 0
    path = Path(uri[len("sqlite:///") :])
    if not path.exists():
        return 0
    con = sqlite3.connect(path, timeout=30)
    try:
        with con:  # one transaction: every table changes or none
            deleted = con.execute(
                "DELETE FROM metrics WHERE run_uuid = ? AND step > ?", (run_id, step)
            ).rowcount
            stale = [
                key
                for (key,) in con.execute(
                    "SELECT key FROM latest_metrics WHERE run_uuid = ? AND step > ?", (run_id, step)
                )
            ]
            for key in stale:
                con.execute("DELETE FROM latest_metrics WHERE run_uuid = ? AND key = ?", (run_id, key))
                con.execute(
                    "INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) "
                    "SELECT key, value, timestamp, step, is_nan, run_uuid FROM metrics "
                    "WHERE run_uuid = ? AND key = ? ORDER BY step DESC, timestamp DESC, value DESC LIMIT 1",
                    (run_id, key),
                )
    finally:
        con.close()
    return deleted


def _delete_traces_after(uri: str, run_id: str, step: int) -> int:
    _silence_mlflow_logging()
    from mlflow.tracking import MlflowClient

    from agentrl.tracking.mlflow_traces import TAG_PREFIX

    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    doomed: list[str] = []
    token = None
    while True:
        page = client.search_traces(
            locations=[experiment_id], run_id=run_id, include_spans=False, max_results=500, page_token=token
        )
        for trace in page:
            tagged = trace.info.tags.get(TAG_PREFIX + "step")
            if tagged is not None and tagged.isdigit() and int(tagged) > step:
                doomed.append(trace.info.trace_id)
        token = page.token
        if not token:
            break
    for i in range(0, len(doomed), 100):
        client.delete_traces(experiment_id, trace_ids=doomed[i : i + 100])
    return len(doomed)
