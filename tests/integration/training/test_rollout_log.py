"""A tiny CPU training saves every step's episodes: files with the documented fields, `agentrl rollouts` prints
one, `load_rollouts` reads them, `trainer.rollout_data_fraction` samples them, and with the mlflow logger
`mlflow.search_traces` returns the last step's episodes with a span per model call (the first
`trainer.rollout_trace_max_episodes` of each split)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl import AgentTrainer, MathAnswerMatch, SingleTurnChatFlow, load_rollouts
from agentrl.data import sample_path
from agentrl.runs.rollout_writer import is_sampled
from agentrl.tracking.mlflow_traces import use_tracking_uri

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[3] / "docs" / "rollouts.md"


def _documented_fields(section: str) -> set[str]:
    """Field names in the first column of the table under `section` in docs/rollouts.md."""
    text = DOC.read_text().split(section, 1)[1]
    table = re.search(r"^\|.*?(?=\n\n|\Z)", text, re.MULTILINE | re.DOTALL).group(0)
    return set(re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE))


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    with open(sample_path("arithmetic_train")) as f:
        return [json.loads(line) for line in f][:8]


def _train(run_dir: Path, rows: list[dict], *extra: str) -> None:
    AgentTrainer(
        flow=SingleTurnChatFlow(),
        evaluator=MathAnswerMatch(),
        train_dataset=rows,
        val_dataset=rows[:2],
        config=[
            "actor_rollout_ref.model.path=tiny:qwen2-mini",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "data.max_response_length=4",
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={run_dir}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            *extra,
        ],
    ).train()


@pytest.fixture(scope="module")
def mlflow_run(tmp_path_factory, rows) -> Path:
    run_dir = tmp_path_factory.mktemp("rollouts") / "run"
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)  # the run's own store, under run_dir
        _train(run_dir, rows, "trainer.logger=[console,mlflow]")
    return run_dir


def test_every_step_is_saved_with_the_documented_fields(mlflow_run):
    folder = mlflow_run / "rollouts"
    assert sorted(p.name for p in folder.iterdir()) == [
        "step_000001.jsonl",
        "step_000002.jsonl",
        "val_step_000000.jsonl",
    ]
    episode_fields = _documented_fields("## Episode fields")
    step_fields = _documented_fields("## Step fields")
    for step in (1, 2):
        records = [json.loads(line) for line in (folder / f"step_00000{step}.jsonl").read_text().splitlines()]
        assert len(records) == 8  # 4 tasks x 2 samples, filtered ones included
        for record in records:
            assert set(record) == episode_fields
            assert record["format_version"] == 1 and record["step"] == step and record["split"] == "train"
            assert record["data_source"] and len(record["config_hash"]) == 16
            (trajectory,) = record["trajectories"]
            (model_call,) = trajectory["steps"]
            assert set(model_call) == step_fields
            assert model_call["messages"][0]["role"] == "user"
            assert len(model_call["response_ids"]) == len(model_call["logprobs"]) > 0
            assert model_call["policy_version"] == record["policy_version"]
            if record["filtered"]:
                assert record["advantage"] is None and record["filter_reason"]
            else:  # kept: trained on, with the advantage its row got (GRPO: same sign as reward - group mean)
                assert record["filter_reason"] is None and record["advantage"] == model_call["advantage"]
        by_task: dict[str, list[dict]] = {}
        for record in records:
            by_task.setdefault(record["task_id"], []).append(record)
        for group in by_task.values():
            mean = sum(r["reward"] for r in group) / len(group)
            for record in group:
                if record["advantage"] is not None and record["reward"] != mean:
                    assert (record["advantage"] > 0) == (record["reward"] > mean)
    val = [json.loads(line) for line in (folder / "val_step_000000.jsonl").read_text().splitlines()]
    assert val and {r["split"] for r in val} == {"val"} and all(r["advantage"] is None for r in val)


def test_cli_prints_one_episode(mlflow_run):
    agentrl = Path(sys.executable).parent / "agentrl"
    shown = subprocess.run(
        [agentrl, "rollouts", str(mlflow_run), "--step", "1", "--episode", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    second = json.loads((mlflow_run / "rollouts" / "step_000001.jsonl").read_text().splitlines()[1])
    assert "train step 1 of 1..2: 8 episodes saved" in shown.stdout
    assert f"episode {second['episode_id']}" in shown.stdout
    assert "[user] " in shown.stdout and "[assistant] " in shown.stdout
    assert f"ended {second['termination_reason']}" in shown.stdout
    missing = subprocess.run(
        [agentrl, "rollouts", str(mlflow_run), "--step", "7"], capture_output=True, text=True
    )
    assert missing.returncode == 1 and "no train rollouts of step 7 (saved steps: 1, 2)" in missing.stderr


def test_load_rollouts_gives_one_row_per_episode(mlflow_run):
    df = load_rollouts(mlflow_run)
    assert len(df) == 16 and sorted(df.step.unique()) == [1, 2]
    assert (df.num_model_calls == 1).all() and (df.response_tokens > 0).all()
    assert set(load_rollouts(mlflow_run, split=None).split) == {"train", "val"}


def test_mlflow_search_traces_returns_the_last_steps_episodes(mlflow_run):
    import mlflow
    from mlflow.entities import SpanType

    last = [
        json.loads(line) for line in (mlflow_run / "rollouts" / "step_000002.jsonl").read_text().splitlines()
    ]
    with use_tracking_uri(f"sqlite:///{mlflow_run}/mlflow.db"):
        experiment = mlflow.get_experiment_by_name("agentrl")
        run_id = (mlflow_run / "mlflow_run_id.txt").read_text().strip()
        traces = mlflow.search_traces(
            locations=[experiment.experiment_id],
            run_id=run_id,
            filter_string="tags.`agentrl.step` = '2' AND tags.`agentrl.split` = 'train'",
            return_type="list",
        )
        # trainer.rollout_trace_freq=25: of steps 1 and 2 only the last is traced.
        not_traced = mlflow.search_traces(
            locations=[experiment.experiment_id],
            filter_string="tags.`agentrl.step` = '1'",
            return_type="list",
        )
    assert not_traced == []
    assert sorted(t.info.tags["agentrl.episode_id"] for t in traces) == sorted(r["episode_id"] for r in last)
    by_id = {r["episode_id"]: r for r in last}
    for trace in traces:
        record = by_id[trace.info.tags["agentrl.episode_id"]]
        assert float(trace.info.tags["agentrl.reward"]) == record["reward"]
        chat = [s for s in trace.data.spans if s.span_type == SpanType.CHAT_MODEL]
        assert len(chat) == 1
        assert (
            chat[0].outputs["choices"][0]["message"]["content"]
            == record["trajectories"][0]["steps"][0]["response"]
        )


def test_trace_max_episodes_traces_the_first_episodes_of_each_split(tmp_path, rows, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    _train(run_dir, rows, "trainer.logger=[console,mlflow]", "trainer.rollout_trace_max_episodes=3")
    saved = {
        split: [
            json.loads(line)["episode_id"] for line in (run_dir / "rollouts" / name).read_text().splitlines()
        ]
        for split, name in (("train", "step_000002.jsonl"), ("val", "val_step_000000.jsonl"))
    }
    with use_tracking_uri(f"sqlite:///{run_dir}/mlflow.db"):
        experiment = mlflow.get_experiment_by_name("agentrl")
        traces = mlflow.search_traces(locations=[experiment.experiment_id], return_type="list")
    traced = {}
    for trace in traces:
        tags = trace.info.tags
        traced.setdefault((tags["agentrl.split"], tags["agentrl.step"]), []).append(
            tags["agentrl.episode_id"]
        )
    assert len(saved["train"]) == 8 and len(saved["val"]) == 2
    assert sorted(traced) == [
        ("train", "2"),
        ("val", "0"),
    ]  # trainer.rollout_trace_freq=25: the last step only
    assert sorted(traced["train", "2"]) == sorted(saved["train"][:3])
    assert sorted(traced["val", "0"]) == sorted(saved["val"])  # fewer than the cap: all of them


def test_fraction_saves_the_sampled_episodes_in_the_configured_folder(tmp_path, rows):
    folder = tmp_path / "elsewhere"
    _train(
        tmp_path / "run",
        rows,
        "trainer.logger=[console]",
        "trainer.rollout_data_fraction=0.5",
        f"trainer.rollout_data_dir={folder}",
        "trainer.val_before_train=false",
        "trainer.total_training_steps=1",
        "data.shuffle=false",
    )
    saved = [
        json.loads(line)["episode_id"] for line in (folder / "step_000001.jsonl").read_text().splitlines()
    ]
    # Unshuffled: step 1 runs rows 0-3, 2 samples each.
    step_one = [f"train-{row['extra_info']['index']}:{k}" for row in rows[:4] for k in range(2)]
    assert sorted(saved) == sorted(e for e in step_one if is_sampled(e, 1, "train", 0.5))
    assert 0 < len(saved) < 8
    assert not (tmp_path / "run" / "rollouts").exists()
    assert len(load_rollouts(tmp_path / "run")) == len(saved)  # found through the run's config.yaml
