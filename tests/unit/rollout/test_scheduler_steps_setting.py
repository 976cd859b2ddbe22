"""`actor_rollout_ref.rollout.num_scheduler_steps`: `auto` decodes several steps per engine step on a GPU under
CUDA graphs only (one replay and one read of the tokens for all; on the CPU a step is its compute), a number wins
anywhere, and a number below one names the key."""

import pytest

from agentrl.config import load_config
from agentrl.rollout.serving.embedded import SCHEDULER_STEPS_UNDER_GRAPHS, scheduler_steps

KEY = "actor_rollout_ref.rollout.num_scheduler_steps"


@pytest.mark.parametrize(
    ("overrides", "device", "steps"),
    [
        ([], "cpu", 1),
        ([], "cuda", SCHEDULER_STEPS_UNDER_GRAPHS),
        ([], "cuda:1", SCHEDULER_STEPS_UNDER_GRAPHS),
        (["actor_rollout_ref.rollout.enforce_eager=true"], "cuda", 1),
        ([f"{KEY}=1"], "cuda", 1),
        ([f"{KEY}=4"], "cpu", 4),
    ],
)
def test_auto_takes_several_steps_under_cuda_graphs_only_and_a_number_wins(overrides, device, steps):
    assert scheduler_steps(load_config(overrides), device) == steps


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_a_bad_setting_names_the_key(value):
    with pytest.raises(Exception, match="num_scheduler_steps"):
        load_config([f"{KEY}={value}"])
