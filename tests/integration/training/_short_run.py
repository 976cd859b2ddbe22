"""The overrides of a one-step training run on the tiny model, shared by the Ray and scale-out tests."""

from __future__ import annotations

from pathlib import Path


def short_run_overrides(run_dir: Path, *extra: str) -> list[str]:
    """One GRPO step of 4 tasks x 4 answers, no warm start, no validation, console only; `extra` last."""
    return [
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.total_training_steps=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "sft.enable=false",
        "data.train_batch_size=4",
        "data.shuffle=false",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        *extra,
    ]
