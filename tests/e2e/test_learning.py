"""End to end on the default task: the model learns, GAE trains a critic, a killed run resumes.

These run the real stack (embedded engine, OpenAI server, gateway, trainer) on the arithmetic task of
`configs/arithmetic.yaml`, with smaller budgets than `make train`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl import AgentTrainer, MathAnswerMatch, SingleTurnChatFlow
from agentrl.config import load_config

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RUN = REPO / "configs" / "arithmetic.yaml"

pytestmark = pytest.mark.slow


def _train(tmp_path: Path, *overrides: str):
    config = load_config(
        ["trainer.logger=[console]", f"trainer.default_local_dir={tmp_path}", *overrides],
        config_path=DEFAULT_RUN,
    )
    return AgentTrainer(flow=SingleTurnChatFlow(), evaluator=MathAnswerMatch(), config=config).train()


def test_grpo_raises_held_out_accuracy_after_the_warm_start(tmp_path):
    result = _train(
        tmp_path, "trainer.total_training_steps=100", "trainer.test_freq=100", "trainer.save_freq=-1"
    )
    before = result.initial_val_metrics["val/accuracy"]
    after = result.metrics["val/accuracy"]
    # The warm start answers about a quarter to a third of the 200 held-out sums. Seed 1 in docs/benchmarks.md
    # went 0.27 -> 0.48 at step 25 -> 0.745 at step 100; on another CPU kind (AMD EPYC with AVX-512: other float
    # rounding, another trajectory) the same code went 0.325 -> 0.285-0.44 over steps 10-60 (the held-out figure
    # swings by +-0.08 between evaluations there) -> 0.605 at step 100, its training reward 0.13 (steps 1-10) ->
    # 0.32 (steps 91-100). So the check is at step 100 and asks for 20 more problems than the warm start.
    assert after >= before + 0.10, (before, after)
    assert result.metrics["val/num_episodes"] == 200
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reward = [
        row["critic/full-score/mean"] for row in history if row.get("critic/full-score/mean") is not None
    ]
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    assert len(reward) == 100 and last >= first + 0.05, (first, last)


def test_gae_trains_a_critic(tmp_path):
    result = _train(
        tmp_path,
        "algorithm.adv_estimator=gae",
        "algorithm.lam=0.95",
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "sft.max_steps=40",
        "critic.optim.lr=1e-3",
    )
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [row["critic/vf_loss"] for row in history if row.get("critic/vf_loss") is not None]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert all(row["critic/grad_norm"] > 0 for row in history if row.get("critic/grad_norm") is not None)
    assert "critic/values/mean" in result.metrics
    assert (result.checkpoint_dir / "critic" / "model.safetensors").exists()


def _command(run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "agentrl.cli", "train", "--config", str(DEFAULT_RUN),
        f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=6", "trainer.save_freq=2",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "sft.max_steps=20",
    ]  # fmt: skip


def _wait_for(path: Path, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, "the run ended before its checkpoint appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.2)


def test_a_killed_run_resumes_from_its_last_checkpoint_with_the_same_command(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(_command(tmp_path), cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    _wait_for(tmp_path / "checkpoints" / "global_step_4" / "COMPLETE", first, timeout=240)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    run_id = (tmp_path / "mlflow_run_id.txt").read_text().strip()

    second = subprocess.run(
        _command(tmp_path), cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stderr and "global_step_4" in second.stderr
    assert "warm start" not in second.stderr  # the warm start belongs to the first run's checkpoint

    steps = [
        json.loads(line)["training/global_step"]
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    steps = sorted({int(s) for s in steps if s is not None})
    assert steps == [1, 2, 3, 4, 5, 6]  # the step numbers continue; nothing restarts at 1
    assert (tmp_path / "mlflow_run_id.txt").read_text().strip() == run_id  # same MLflow run
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = {m.step for m in client.get_metric_history(run_id, "critic/full-score/mean")}
    assert logged == {1, 2, 3, 4, 5, 6}
    assert (tmp_path / "checkpoints" / "global_step_6" / "COMPLETE").exists()
    assert (tmp_path / "hf_model" / "config.json").exists()
