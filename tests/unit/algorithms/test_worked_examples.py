"""The worked examples of docs/algorithms.md, one test per case, each computed by hand in its docstring.

They pin down the semantics users of verl and rLLM expect (issue 9): how a trajectory counts in its
group, step-wise advantages, groups of one, termination reasons, config refusals, rejection
sampling and the REINFORCE++ family.
"""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.algorithms import compute_advantages

S2 = 1 / math.sqrt(2)


def test_case8_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens_over_tokens():
    """reinforce_plus_plus_baseline (verl's formula).

    Rows (scores on the last valid token): group 0 = row 0 (score 1, 2 tokens), row 1 (score 0,
    2 tokens); group 1 = row 2 (score 1, 1 token, a group of one).
        centred scores: group 0 mean 0.5 -> +0.5, -0.5; group 1 alone -> mean 0 -> 1
        on tokens: [0.5, 0.5, -0.5, -0.5, 1]; mean 0.2; deviations [0.3, 0.3, -0.7, -0.7, 0.8]
        unbiased var = (0.09 + 0.09 + 0.49 + 0.49 + 0.64) / 4 = 0.45, std = 0.670820
        A = [0.447214, 0.447214, -1.043498, -1.043498, 1.192570]
    """
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    res = compute_advantages(
        "reinforce_plus_plus_baseline",
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.tensor([0, 0, 1]),
    )
    expected = torch.tensor([[0.447214, 0.447214], [-1.043498, -1.043498], [1.192570, 0.0]])
    torch.testing.assert_close(res.advantages, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(res.returns, res.advantages)


def test_case8_masked_reinforce_plus_plus_return_resets_at_the_gap():
    """REINFORCE++ returns do not carry across a masked gap (verl multiplies the running return by the mask).

    gamma 1. Row 0: tokens [model, observation, model], reward 1 on the last token.
    Row 1: three model tokens, reward 1 on the last.
        row 0: G_2 = 1; the observation at t=1 resets the running return; G_0 = 0 + 1 * 0 = 0
               (skipping the gap instead would give G_0 = 1)
        row 1: G = [1, 1, 1]
        valid G = [0, 1, 1, 1, 1]: mean 0.8, unbiased var (0.64 + 4 * 0.04) / 4 = 0.2, std 0.447214
        A = [(0 - 0.8) / 0.447214, (1 - 0.8) / 0.447214] = [-1.788854, 0.447214]
    """
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[True, False, True], [True, True, True]])
    res = compute_advantages(
        "reinforce_plus_plus", token_rewards=rewards, response_mask=mask, group_ids=torch.arange(2)
    )
    torch.testing.assert_close(res.returns, torch.tensor([[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))
    a, b = -1.788854, 0.447214
    torch.testing.assert_close(res.advantages, torch.tensor([[a, 0.0, b], [b, b, b]]), atol=1e-5, rtol=0)
    # plain `reinforce` keeps skipping the gap: G_0 of row 0 is the reward behind the observation
    plain = compute_advantages(
        "reinforce", token_rewards=rewards, response_mask=mask, group_ids=torch.arange(2)
    )
    assert plain.returns[0].tolist() == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_accept_sample_ids_and_reject_a_sample_in_two_groups(estimator):
    """A sample (trajectory) must sit in one group; rows of one sample in two groups are an error."""
    rewards, mask = torch.ones(2, 1), torch.ones(2, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="same sample_ids must have the same group_ids"):
        compute_advantages(
            estimator,
            token_rewards=rewards,
            response_mask=mask,
            group_ids=torch.tensor([0, 1]),
            sample_ids=torch.tensor([3, 3]),
        )
