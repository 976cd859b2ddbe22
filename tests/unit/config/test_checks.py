"""Cross-field rules: each broken rule is reported with the keys involved and a fix; all at once."""

from __future__ import annotations

import pytest

from agentrl.config import validate_config


@pytest.mark.parametrize(
    ("dotted", "fragments"),
    [
        (
            {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 3},
            [
                "actor_rollout_ref.actor.ppo_mini_batch_size=8 (32 rows per device",
                "ppo_micro_batch_size_per_gpu=3",
                "[1, 2, 4, 8, 16, 32]",
            ],
        ),
        (
            {"actor_rollout_ref.actor.ppo_mini_batch_size": 16},
            ["actor_rollout_ref.actor.ppo_mini_batch_size=16 is larger than data.train_batch_size=8"],
        ),
        (
            {
                "trainer.backend": "ray",
                "trainer.n_gpus_per_node": 3,
                "actor_rollout_ref.actor.ppo_mini_batch_size": 1,
            },
            ["ppo_mini_batch_size=1 x actor_rollout_ref.rollout.n=4 = 4 rows", "over 3 devices"],
        ),
        (
            {"algorithm.adv_estimator": "gae", "critic.ppo_micro_batch_size_per_gpu": 5},
            ["critic.ppo_mini_batch_size=8", "critic.ppo_micro_batch_size_per_gpu=5"],
        ),
        ({"actor_rollout_ref.rollout.n": 1}, ["actor_rollout_ref.rollout.n=1", "adv_estimator=grpo", "n>=2"]),
        ({"actor_rollout_ref.rollout.n": 1, "algorithm.adv_estimator": "rloo"}, ["adv_estimator=rloo"]),
        (
            {
                "actor_rollout_ref.rollout.n": 1,
                "algorithm.adv_estimator": "reinforce_plus_plus",
                "agent.rejection_sample.enable": True,
            },
            ["agent.rejection_sample.enable=true", "rollout.n=1"],
        ),
        (
            {"actor_rollout_ref.actor.use_kl_loss": True, "algorithm.use_kl_in_reward": True},
            ["actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"],
        ),
        (
            {"trainer.resume_mode": "resume_path"},
            ["trainer.resume_mode=resume_path needs trainer.resume_from_path"],
        ),
        (
            {"trainer.resume_from_path": "ckpt/global_step_3"},
            ["trainer.resume_from_path='ckpt/global_step_3' is ignored", "trainer.resume_mode=resume_path"],
        ),
        (
            {"agent.stepwise_advantage.mode": "per_step"},
            ["agent.stepwise_advantage.mode=per_step has no effect", "enable=true"],
        ),
        (
            {
                "agent.stepwise_advantage.enable": True,
                "agent.stepwise_advantage.mode": "per_step",
                "agent.stepwise_advantage.normalize_by_steps": True,
            },
            [
                "agent.stepwise_advantage.normalize_by_steps=true only applies to mode=broadcast",
                "mode=per_step",
            ],
        ),
        (
            {"agent.rejection_sample.mode": "solve_partial"},
            ["agent.rejection_sample.mode=solve_partial has no effect", "enable=true"],
        ),
        (
            {"agent.rejection_sample.multiplier": 3},
            ["agent.rejection_sample.multiplier=3 has no effect", "enable=true"],
        ),
        (
            {"agent.stepwise_advantage.enable": True, "algorithm.adv_estimator": "gae"},
            ["algorithm.adv_estimator=gae cannot be used with agent.stepwise_advantage.enable=true"],
        ),
        (
            {"actor_rollout_ref.rollout.max_model_len": 300},
            ["actor_rollout_ref.rollout.max_model_len=300", ">= 320"],
        ),
        (
            {"actor_rollout_ref.rollout.tensor_model_parallel_size": 2},
            ["tensor_model_parallel_size=2 needs actor_rollout_ref.rollout.name=vllm"],
        ),
        (
            {
                "actor_rollout_ref.rollout.name": "vllm",
                "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
                "trainer.backend": "ray",
                "trainer.n_gpus_per_node": 3,
                "actor_rollout_ref.actor.ppo_mini_batch_size": 3,
                "data.train_batch_size": 3,
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
            },
            ["tensor_model_parallel_size=2 does not divide the 3"],
        ),
        ({"trainer.n_gpus_per_node": 2}, ["trainer.backend=local", "= 2", "trainer.backend=ray"]),
        (
            {
                "trainer.backend": "ray",
                "trainer.n_gpus_per_node": 4,
                "actor_rollout_ref.actor.fsdp_config.fsdp_size": 3,
            },
            ["actor_rollout_ref.actor.fsdp_config.fsdp_size=3 does not divide the 4 devices", "[1, 2, 4]"],
        ),
        (
            {"resource_pool_config.critic_gpus": 2},
            ["resource_pool_config.critic_gpus=2 is more than the 1 devices"],
        ),
        (
            {"actor_rollout_ref.rollout.val_kwargs.do_sample": True},
            ["actor_rollout_ref.rollout.val_kwargs.do_sample=true with temperature=0.0"],
        ),
        (
            {"actor_rollout_ref.rollout.val_kwargs.n": 4},
            ["actor_rollout_ref.rollout.val_kwargs.n=4 with do_sample=false"],
        ),
        (
            {
                "algorithm.rollout_correction.bypass_mode": True,
                "algorithm.rollout_correction.tis_mode": "token",
            },
            ["algorithm.rollout_correction.bypass_mode=true with tis_mode=token", "set tis_mode=null"],
        ),
        (
            {"actor_rollout_ref.rollout.temperature": 0.0},
            ["actor_rollout_ref.rollout.temperature=0.0 samples training episodes greedily", "set it > 0"],
        ),
        ({"sft.stop_accuracy": 0.5}, ["sft.stop_accuracy=0.5 needs held-out rows", "sft.val_rows=0"]),
        (
            {"async_training.reuse_stale_prefixes": True},
            ["async_training.reuse_stale_prefixes=true with enable=false", "set reuse_stale_prefixes=false"],
        ),
        (
            {
                "async_training.reuse_stale_prefixes": True,
                "async_training.enable": True,
                "actor_rollout_ref.rollout.name": "vllm",
            },
            ["actor_rollout_ref.rollout.name=vllm: only the embedded engine keeps prefixes"],
        ),
        (
            {"async_training.streaming_update": True},
            ["async_training.streaming_update=true needs async_training.enable=true", "enable=false"],
        ),
        (
            {
                "async_training.streaming_update": True,
                "async_training.enable": True,
                "algorithm.adv_estimator": "reinforce_plus_plus",
            },
            [
                "streaming_update=true needs algorithm.adv_estimator in ['grpo', 'rloo'] (got reinforce_plus_plus)"
            ],
        ),
        (
            {
                "async_training.streaming_update": True,
                "async_training.enable": True,
                "actor_rollout_ref.actor.ppo_epochs": 2,
            },
            ["streaming_update=true needs one optimizer step an update: actor.ppo_epochs=1", "(got 2 and"],
        ),
        (
            {
                "async_training.streaming_update": True,
                "async_training.enable": True,
                "agent.rejection_sample.enable": True,
                "agent.rejection_sample.multiplier": 3,
            },
            ["streaming_update=true needs agent.rejection_sample.multiplier=1"],
        ),
    ],
)
def test_broken_rule_names_keys_and_fix(problems_for, dotted, fragments):
    (message,) = problems_for(dotted)
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    "dotted",
    [
        {"actor_rollout_ref.rollout.n": 2},
        {"actor_rollout_ref.rollout.n": 1, "algorithm.adv_estimator": "reinforce"},
        {
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 3,
            "actor_rollout_ref.actor.use_dynamic_bsz": True,
        },
        {"critic.ppo_micro_batch_size_per_gpu": 5},  # critic unused unless gae
        {"actor_rollout_ref.rollout.max_model_len": 320},
        {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": "ckpt/global_step_3"},
        {
            "agent.stepwise_advantage.enable": True,
            "agent.stepwise_advantage.mode": "broadcast",
            "agent.stepwise_advantage.normalize_by_steps": True,
        },
        {"trainer.backend": "ray", "trainer.n_gpus_per_node": 2, "resource_pool_config.critic_gpus": 2},
        {
            "trainer.backend": "ray",
            "trainer.n_gpus_per_node": 2,
            "trainer.nnodes": 2,
            "actor_rollout_ref.actor.fsdp_config.fsdp_size": 2,  # HSDP: shard within a node
        },
        {
            "actor_rollout_ref.rollout.val_kwargs.do_sample": True,
            "actor_rollout_ref.rollout.val_kwargs.temperature": 0.7,
            "actor_rollout_ref.rollout.val_kwargs.n": 4,
        },
    ],
)
def test_consistent_settings_pass(nested, dotted):
    validate_config(nested(dotted))


def test_micro_batch_rule_counts_rows_per_device(nested):
    # 8 tasks x n=4 = 32 rows over 2 devices = 16 rows each: micro 8 divides, micro 32 does not.
    base = {"trainer.backend": "ray", "trainer.n_gpus_per_node": 2}
    validate_config(nested({**base, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8}))
    with pytest.raises(Exception, match=r"\(16 rows per device"):
        validate_config(nested({**base, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 32}))


def test_all_broken_rules_are_reported_at_once(problems_for):
    problems = problems_for(
        {
            "actor_rollout_ref.rollout.n": 1,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 3,
            "trainer.resume_mode": "resume_path",
            "actor_rollout_ref.actor.use_kl_loss": True,
            "algorithm.use_kl_in_reward": True,
        }
    )
    assert len(problems) == 4
    assert any("ppo_micro_batch_size_per_gpu=3" in p for p in problems)
    assert any("rollout.n=1" in p and "grpo" in p for p in problems)
    assert any("resume_from_path" in p for p in problems)
    assert any("use_kl_in_reward" in p for p in problems)
