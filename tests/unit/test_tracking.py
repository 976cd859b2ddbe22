"""Tracking: console line, JSONL history, real MLflow (SQLite in tmp_path), resume, progress bars."""

import json
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from agentrl.tracking import (
    build_tracker,
    flatten_config,
    format_console_line,
    progress_bar,
    read_metrics_history,
    set_progress_postfix,
)

CONFIG = {
    "trainer": {"logger": ["console", "mlflow"], "project_name": "proj", "save_freq": 5},
    "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}, "model": {"path": "tiny:qwen2"}},
    "data": {"val_batch_size": None, "long_value": "x" * 7000},
}


@pytest.fixture(autouse=True)
def _no_env_uri(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _build(run_dir, loggers=("mlflow",), config=CONFIG, resume=True):
    return build_tracker(
        list(loggers),
        run_dir=run_dir,
        project_name="proj",
        experiment_name="exp1",
        config=config,
        resume=resume,
    )


def _history(tracker, key):
    client = MlflowClient(tracker.backends["mlflow"].tracking_uri)
    return [
        (m.step, m.value)
        for m in sorted(client.get_metric_history(tracker.mlflow_run_id, key), key=lambda m: m.step)
    ]


def test_unknown_logger_names_config_key_and_allowed_values(tmp_path):
    with pytest.raises(ValueError) as err:
        _build(tmp_path, loggers=("console", "wandb"))
    message = str(err.value)
    assert "trainer.logger" in message and "wandb" in message
    assert "console" in message and "mlflow" in message


def test_flatten_config_dotted_string_values():
    flat = flatten_config({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": None, "f": {}})
    assert flat == {"a.b.c": "1", "a.d": "[1, 2]", "e": "None", "f": "{}"}


def test_mlflow_logs_metrics_params_and_status(tmp_path):
    with _build(tmp_path) as tracker:
        for step, loss in [(1, 0.5), (2, 0.25), (3, -0.125)]:
            tracker.log({"actor/pg_loss": loss, "critic/full-score/mean": step / 10}, step=step)
        run_id = tracker.mlflow_run_id
        assert _history(tracker, "actor/pg_loss") == [(1, 0.5), (2, 0.25), (3, -0.125)]
    assert (tmp_path / "mlflow.db").exists()
    assert (tmp_path / "mlflow_run_id.txt").read_text().strip() == run_id
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "exp1"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert (
        client.get_experiment(run.info.experiment_id).artifact_location == (tmp_path / "mlartifacts").as_uri()
    )
    params = run.data.params
    assert params["trainer.logger"] == "['console', 'mlflow']"
    assert params["actor_rollout_ref.actor.optim.lr"] == "1e-06"
    assert params["data.val_batch_size"] == "None"
    assert len(params["data.long_value"]) == 6000 and params["data.long_value"].endswith("...(truncated)")


def test_resume_reuses_run_and_continues_steps(tmp_path):
    with pytest.raises(RuntimeError), _build(tmp_path) as first:
        first.log({"actor/pg_loss": 1.0}, step=1)
        first.log({"actor/pg_loss": 2.0}, step=2)
        raise RuntimeError("killed mid-run")
    client = MlflowClient(first.backends["mlflow"].tracking_uri)
    assert client.get_run(first.mlflow_run_id).info.status == "FAILED"

    changed = {**CONFIG, "trainer": {**CONFIG["trainer"], "save_freq": 10}}
    with _build(tmp_path, config=changed) as second:
        assert second.mlflow_run_id == first.mlflow_run_id
        assert client.get_run(second.mlflow_run_id).info.status == "RUNNING"
        second.log({"actor/pg_loss": 3.0}, step=3)
        assert [r["step"] for r in second.history] == [1, 2, 3]
    assert _history(second, "actor/pg_loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    run = client.get_run(first.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.save_freq"] == "5"  # MLflow forbids changing a param
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_fresh_start_in_same_run_dir_starts_a_new_run(tmp_path):
    with _build(tmp_path) as first:
        first.log({"actor/pg_loss": 1.0}, step=1)
        first.log({"actor/pg_loss": 2.0}, step=2)
    with _build(tmp_path, resume=False) as second:
        assert second.mlflow_run_id != first.mlflow_run_id
        assert second.history == []
        second.log({"actor/pg_loss": 5.0}, step=1)
    assert (tmp_path / "mlflow_run_id.txt").read_text().strip() == second.mlflow_run_id
    assert _history(second, "actor/pg_loss") == [(1, 5.0)]
    assert _history(first, "actor/pg_loss") == [(1, 1.0), (2, 2.0)]
    assert read_metrics_history(tmp_path) == [{"step": 1, "actor/pg_loss": 5.0}]
    (archived,) = tmp_path.glob("metrics.*.jsonl")
    assert len(archived.read_text().splitlines()) == 2


def test_non_finite_values_skipped_and_counted(tmp_path):
    with _build(tmp_path) as tracker:
        tracker.log({"actor/kl_loss": float("nan"), "actor/pg_loss": 1.5}, step=1)
        tracker.log({"actor/kl_loss": float("inf"), "actor/pg_loss": 2.5}, step=2)
        assert tracker.backends["mlflow"].skipped_non_finite == {"actor/kl_loss": 2}
        assert _history(tracker, "actor/kl_loss") == []
        assert _history(tracker, "actor/pg_loss") == [(1, 1.5), (2, 2.5)]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "actor/kl_loss": None, "actor/pg_loss": 1.5}


def test_metric_names_sanitized_only_when_mlflow_rejects_them(tmp_path):
    with _build(tmp_path) as tracker:
        tracker.log({"val/test_score/openai/gsm8k": 0.5, "reward (mean)%": 1.0, "a//b": 2.0}, step=1)
        client = MlflowClient(tracker.backends["mlflow"].tracking_uri)
        keys = set(client.get_run(tracker.mlflow_run_id).data.metrics)
    assert keys == {"val/test_score/openai/gsm8k", "reward _mean__", "a/b"}


def test_metric_with_non_number_value_names_the_key(tmp_path):
    tracker = _build(tmp_path, loggers=())
    with pytest.raises(TypeError, match="actor/pg_loss"):
        tracker.log({"actor/pg_loss": "high"}, step=1)


def test_env_tracking_uri_wins(tmp_path, monkeypatch):
    elsewhere = tmp_path / "shared"
    elsewhere.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{elsewhere}/store.db")
    with _build(tmp_path / "run") as tracker:
        tracker.log({"actor/pg_loss": 0.1}, step=1)
    assert (elsewhere / "store.db").exists()
    assert not (tmp_path / "run" / "mlflow.db").exists()
    assert _history(tracker, "actor/pg_loss") == [(1, 0.1)]


def test_console_line_format(capsys, tmp_path):
    metrics = {
        "critic/full-score/mean": 0.3125,
        "actor/pg_loss": -0.021349,
        "actor/kl_loss": 0.000123,
        "perf/throughput": 1534.26,
        "val/test_score/gsm8k": 0.4,
        "timing/update": 1.25,
        "timing/gen": 3.5,
        "actor/grad_norm": 9.0,
    }
    with _build(tmp_path, loggers=("console",)) as tracker:
        tracker.log(metrics, step=12)
    out = capsys.readouterr().out
    assert out == (
        "step 12 | reward 0.3125 | pg_loss -0.02135 | kl_loss 1.23e-04 | tok/s 1534 | gsm8k 0.4"
        " | gen 3.5s update 1.25s\n"
    )
    assert format_console_line({}, 3) == "step 3"


def test_history_file_merges_steps_and_skips_torn_line(tmp_path):
    tracker = _build(tmp_path, loggers=())
    tracker.log({"critic/full-score/mean": 0.1}, step=1)
    tracker.log({"critic/full-score/mean": 0.2}, step=2)
    tracker.log({"val/test_score/gsm8k": 0.5}, step=2)
    tracker.log({"critic/full-score/mean": 0.25}, step=2)  # a resumed run redoing step 2
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "critic/full')  # died mid-write
    history = read_metrics_history(tmp_path)
    assert history == [
        {"step": 1, "critic/full-score/mean": 0.1},
        {"step": 2, "critic/full-score/mean": 0.25, "val/test_score/gsm8k": 0.5},
    ]
    assert tracker.history == history
    assert read_metrics_history(tmp_path / "missing") == []


def test_mlflow_is_imported_lazily(tmp_path):
    code = (
        "import sys; from pathlib import Path; from agentrl.tracking import build_tracker;"
        f"t = build_tracker(['console'], run_dir=Path({str(tmp_path)!r}), project_name='p',"
        " experiment_name='e', config={}); t.log({'x': 1.0}, step=1); t.finish();"
        "print('mlflow' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_progress_bar_forced_on_shows_postfix(capsys, monkeypatch):
    monkeypatch.setenv("AGENTRL_PROGRESS", "1")
    bar = progress_bar("rollout", total=4, leave=True)
    bar.update(4)
    set_progress_postfix(bar, step=7, reward=0.5, throughput=812.4)
    bar.close()
    last = capsys.readouterr().err.rstrip("\n").split("\r")[-1]
    assert last.startswith("rollout: 100%") and "4/4" in last
    assert last.rstrip().endswith("step=7, reward=0.5, tok/s=812]")


def test_progress_bar_off_when_not_a_tty(capsys, monkeypatch):
    monkeypatch.delenv("AGENTRL_PROGRESS", raising=False)
    bar = progress_bar("update", total=2)
    bar.update(2)
    bar.close()
    assert bar.disable and capsys.readouterr().err == ""
    monkeypatch.setenv("AGENTRL_PROGRESS", "0")
    assert progress_bar("val", total=1).disable
