"""A resumed run's history cut back to its checkpoint (`agentrl.runs.truncate`): metrics.jsonl, rollout files,
the MLflow run's metric values and traces. The end-to-end check with a real SIGKILL is in
tests/e2e/test_exact_resume.py."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from agentrl.runs.history import METRICS_FILE, read_metrics_history
from agentrl.runs.rollout_files import rollout_steps
from agentrl.runs.rollout_writer import RolloutLog
from agentrl.runs.truncate import truncate_run_history
from agentrl.tracking import build_tracker
from agentrl.types import Episode


@pytest.fixture(autouse=True)
def _no_env_uri(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _tracker(run_dir, loggers=("mlflow",)):
    return build_tracker(
        list(loggers), run_dir=run_dir, project_name="proj", experiment_name="e", config={}, resume=True
    )


def _lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_metrics_jsonl_keeps_each_step_up_to_the_checkpoint_once(tmp_path):
    tracker = _tracker(tmp_path, loggers=())
    tracker.log({"val/accuracy": 0.1}, step=0)
    for step in range(1, 8):  # killed after step 7, last checkpoint at step 4
        tracker.log({"loss": float(step)}, step=step)
    tracker.log({"val/accuracy": 0.5}, step=4)  # logged separately: merged into step 4's one line
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"step": 8, "lo')  # torn by the kill

    done = truncate_run_history(tmp_path, 4)
    assert [r["step"] for r in _lines(tmp_path)] == [0, 1, 2, 3, 4]
    assert _lines(tmp_path)[4] == {"step": 4, "loss": 4.0, "val/accuracy": 0.5}
    assert done.metrics_records == 5  # steps 5, 6, 7, the repeat of 4 and the torn line
    assert not list(tmp_path.glob(".metrics.jsonl.*"))  # written to a temporary file and renamed

    resumed = _tracker(tmp_path, loggers=())  # the rerun redoes steps 5..8
    for step in range(5, 9):
        resumed.log({"loss": step + 0.5}, step=step)
    assert [r["step"] for r in _lines(tmp_path)] == list(range(9))
    assert read_metrics_history(tmp_path)[5]["loss"] == 5.5

    before = (tmp_path / METRICS_FILE).stat().st_mtime_ns
    assert (
        truncate_run_history(tmp_path, 8).metrics_records == 0
    )  # nothing to drop: the file is not rewritten
    assert (tmp_path / METRICS_FILE).stat().st_mtime_ns == before
    assert truncate_run_history(tmp_path / "fresh", 3).metrics_records == 0  # no history yet


def test_rollout_files_after_the_checkpoint_are_deleted(tmp_path):
    folder = tmp_path / "rollouts"
    log = RolloutLog(folder, fraction=1.0, config_digest="x")
    for step in range(1, 8):
        log.write(step, [Episode(id=f"t:{step}")])
    log.write(4, [Episode(id="v:0")], split="val")
    log.write(6, [Episode(id="v:0")], split="val")
    (folder / "step_000008.jsonl.tmp").write_text("half")  # a write the kill interrupted

    done = truncate_run_history(tmp_path, 4, rollouts_dir=folder)
    assert rollout_steps(folder) == [1, 2, 3, 4] and rollout_steps(folder, "val") == [4]
    assert sorted(p.name for p in done.rollout_files) == [
        "step_000005.jsonl", "step_000006.jsonl", "step_000007.jsonl", "step_000008.jsonl.tmp",
        "val_step_000006.jsonl",
    ]  # fmt: skip
    assert truncate_run_history(tmp_path, 4).rollout_files == []  # the default folder does not exist: no-op


def test_mlflow_metric_values_and_traces_after_the_checkpoint_are_removed(tmp_path):
    with _tracker(tmp_path) as tracker:
        for step in range(1, 8):
            tracker.log(
                {"loss": float(step), "only_late": float(step)} if step > 4 else {"loss": float(step)}, step
            )
        records = [
            {"step": step, "split": "train", "episode_id": f"t:{step}", "task_id": "t", "data_source": "d",
             "config_hash": "x", "policy_version": 0, "reward": 1.0, "is_correct": True, "advantage": 0.0,
             "termination_reason": "env_done", "filtered": False, "filter_reason": None, "answer": "a",
             "error": None, "trajectories": []}
            for step in (2, 6)
        ]  # fmt: skip
        tracker.log_rollouts(records, step=6)
        run_id = tracker.mlflow_run_id
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment_id = client.get_run(run_id).info.experiment_id
    assert len(client.search_traces(locations=[experiment_id], run_id=run_id)) == 2

    done = truncate_run_history(tmp_path, 4)
    assert (done.mlflow_metrics, done.mlflow_traces) == (6, 1)
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3, 4]
    assert client.get_metric_history(run_id, "only_late") == []
    assert client.get_run(run_id).data.metrics == {"loss": 4.0}  # the latest values, recomputed
    [kept] = client.search_traces(locations=[experiment_id], run_id=run_id)
    assert kept.info.tags["agentrl.step"] == "2"

    with _tracker(tmp_path) as resumed:  # the rerun logs steps 5.. again: once each
        resumed.log({"loss": 5.5}, step=5)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")][-2:] == [(4, 4.0), (5, 5.5)]


def test_a_tracking_server_keeps_its_metric_values_and_says_so(tmp_path, monkeypatch, caplog):
    from agentrl.tracking import mlflow_backend

    (tmp_path / "mlflow_run_id.txt").write_text("abc\n")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setattr(mlflow_backend, "_delete_traces_after", lambda uri, run_id, step: 0)
    assert mlflow_backend.truncate_mlflow_history(tmp_path, 3) == {"metrics": 0, "traces": 0}
    assert "cannot delete them" in caplog.text and "two values" in caplog.text


def test_step_must_be_a_non_negative_int(tmp_path):
    with pytest.raises(ValueError, match="non-negative int"):
        truncate_run_history(tmp_path, -1)
