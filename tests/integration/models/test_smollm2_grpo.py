"""One GRPO step on CPU with `actor_rollout_ref.model.path=smollm2-135m-instruct`: the real 135M instruct model
rolls out through the embedded engine, trains on non-zero advantages, and its new weights sync back to the
engine (the sync checks the served fingerprint and raises on a mismatch), with finite losses. Tiny sizes keep
it to about a minute on 2 cores (plus the session's one conversion, about 40 s)."""

from __future__ import annotations

import json
import math

import pytest

from agentrl import AgentTrainer, SingleTurnChatFlow, evaluator
from agentrl.data import sample_path
from agentrl.models import SMOLLM2_NAME

pytestmark = pytest.mark.slow


@evaluator
def text_checksum(task, episode) -> float:
    """Different answers get different rewards, so every GRPO group has advantages to learn from (the untuned
    model rarely gets a sum right in 16 tokens, and all-zero rewards would train nothing)."""
    return sum(map(ord, episode.answer or "")) % 101 / 100


def test_one_grpo_step_trains_and_syncs(smollm2_cache_env, tmp_path):
    with open(sample_path("arithmetic_train")) as f:
        rows = [json.loads(line) for line in f][:2]
    result = AgentTrainer(
        flow=SingleTurnChatFlow(),
        evaluator=text_checksum,
        train_dataset=rows,
        config=[
            f"actor_rollout_ref.model.path={SMOLLM2_NAME}",
            "data.train_batch_size=2",
            "data.max_prompt_length=128",
            "data.max_response_length=16",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.max_num_seqs=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.optim.lr=1e-5",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.logger=[console]",
            "trainer.device=cpu",
            "sft.enable=false",
            f"trainer.default_local_dir={tmp_path}",
        ],
    ).train()
    metrics = result.metrics
    assert result.global_step == 1
    assert metrics["batch/rows"] == 4
    for key in ("actor/pg_loss", "actor/loss", "actor/entropy", "actor/grad_norm"):
        assert math.isfinite(metrics[key]), (key, metrics[key])
    assert metrics["critic/advantages/max"] > 0 and metrics["actor/grad_norm"] > 0  # the weights moved
    assert metrics["rollout/policy_version"] == 2  # the start's sync, then the trained weights'
    assert metrics["rollout/logprob_diff_max"] < 1e-3  # the engine's logprobs are the trainer's
    assert (result.export_dir / "config.json").exists()
