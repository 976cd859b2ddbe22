"""Which policy workers share their device with another process (their engine's sleep then empties PyTorch's
cache for it) and which keep the cache for their own trainer."""

from __future__ import annotations

import pytest

from agentrl.config import load_config
from agentrl.training.workers.policy_worker import shares_device


@pytest.mark.parametrize(
    "backend, estimator, shared",
    [("local", "grpo", False), ("local", "gae", False), ("ray", "grpo", False), ("ray", "gae", True)],
)
def test_only_a_critic_in_other_processes_shares_the_policy_device(backend, estimator, shared):
    config = load_config([f"trainer.backend={backend}", f"algorithm.adv_estimator={estimator}"])
    assert shares_device(config) is shared
