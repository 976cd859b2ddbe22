"""Advantage estimators: hand-computed cases, properties, and the registry."""

import math

import pytest
import torch

from agentrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageResult,
    compute_advantages,
    compute_discounted_returns,
    compute_gae_advantages,
    register_advantage_estimator,
)

ALL_ESTIMATORS = ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "reinforce"]


def _outcome_batch(scores, width=3):
    """One row per score, the score on the last valid token; row i has (i % width) + 1 valid tokens."""
    b = len(scores)
    rewards = torch.zeros(b, width)
    mask = torch.zeros(b, width, dtype=torch.bool)
    for i, s in enumerate(scores):
        n = i % width + 1
        mask[i, :n] = True
        rewards[i, n - 1] = s
    return rewards, mask


def _row_values(advantages, mask):
    """The single value each row carries on its valid tokens (outcome estimators)."""
    return torch.stack([advantages[i][mask[i]][0] for i in range(advantages.shape[0])])


def test_builtin_estimators_registered():
    assert set(ALL_ESTIMATORS) <= set(ADVANTAGE_ESTIMATORS)


def test_grpo_hand_computed():
    # groups: 0 -> scores [1, 0, 2]; 1 -> [3, 1]; 2 -> [5] (singleton)
    # group 0: mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1       -> A = [0, -1, 1]
    # group 1: mean 2, unbiased std sqrt((1 + 1) / 1) = sqrt(2)     -> A = [1/sqrt2, -1/sqrt2]
    # group 2: a group of one gets verl's mean 0, std 1              -> A = 5 / (1 + 1e-6)
    rewards, mask = _outcome_batch([1.0, 0.0, 2.0, 3.0, 1.0, 5.0])
    # row 0 spreads its score over two tokens (0.5 + 0.5 = 1) and has 9 on a padding token (ignored)
    rewards[0] = torch.tensor([0.5, 0.5, 9.0])
    mask[0] = torch.tensor([True, True, False])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    res = compute_advantages("grpo", token_rewards=rewards, response_mask=mask, group_ids=groups)
    s = 1 / math.sqrt(2)
    expected = torch.tensor([0.0, -1.0, 1.0, s, -s, 5.0 / (1 + 1e-6)])
    torch.testing.assert_close(_row_values(res.advantages, mask), expected, atol=1e-5, rtol=0)
    # broadcast over valid tokens only, zero elsewhere; returns equal advantages
    assert torch.all(res.advantages[~mask] == 0)
    torch.testing.assert_close(res.advantages[1], torch.tensor([-1.0, -1.0, 0.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(res.returns, res.advantages)


def test_grpo_without_std_division():
    # same groups, no std division: group 0 -> [0, -1, 1]; group 1 -> [3-2, 1-2] = [1, -1];
    # the singleton's baseline is 0 (verl), so it keeps its score 5
    rewards, mask = _outcome_batch([1.0, 0.0, 2.0, 3.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    res = compute_advantages(
        "grpo", token_rewards=rewards, response_mask=mask, group_ids=groups, norm_adv_by_std_in_grpo=False
    )
    expected = torch.tensor([0.0, -1.0, 1.0, 1.0, -1.0, 5.0])
    torch.testing.assert_close(_row_values(res.advantages, mask), expected)


def test_grpo_equal_scores_give_zero_not_nan():
    rewards, mask = _outcome_batch([1.0, 1.0, 1.0])
    res = compute_advantages(
        "grpo", token_rewards=rewards, response_mask=mask, group_ids=torch.zeros(3).long()
    )
    assert torch.all(res.advantages == 0)


def test_rloo_hand_computed():
    # group 0 scores [1, 0, 2]: A_i = s_i - mean(others): 1 - 1 = 0, 0 - 1.5 = -1.5, 2 - 0.5 = 1.5
    # group 1 scores [3, 1]:   3 - 1 = 2, 1 - 3 = -2;  group 2 (singleton, baseline 0 as verl): 5
    rewards, mask = _outcome_batch([1.0, 0.0, 2.0, 3.0, 1.0, 5.0])
    groups = torch.tensor([4, 4, 4, 9, 9, 1])  # ids need not be dense
    res = compute_advantages("rloo", token_rewards=rewards, response_mask=mask, group_ids=groups)
    expected = torch.tensor([0.0, -1.5, 1.5, 2.0, -2.0, 5.0])
    torch.testing.assert_close(_row_values(res.advantages, mask), expected)
    assert torch.all(res.advantages[~mask] == 0)


def test_gae_hand_computed_raw_and_whitened():
    # gamma 0.9, lam 0.8, rewards [0, 0, 1], values [0.5, 0.6, 0.7]
    # t=2: delta = 1 + 0 - 0.7 = 0.3                 A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03          A1 = 0.03 + 0.72*0.3   = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04          A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    # whitened: mean 0.254373, unbiased std 0.042070 -> [-0.8855, -0.1990, 1.0845]
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    raw = compute_gae_advantages(
        token_rewards=rewards, response_mask=mask, values=values, gamma=0.9, lam=0.8, whiten=False
    )
    torch.testing.assert_close(raw.advantages, torch.tensor([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(raw.returns, torch.tensor([[0.71712, 0.846, 1.0]]))
    res = compute_advantages(
        "gae",
        token_rewards=rewards,
        response_mask=mask,
        group_ids=torch.zeros(1).long(),
        values=values,
        gamma=0.9,
        lam=0.8,
    )
    torch.testing.assert_close(res.advantages, torch.tensor([[-0.8855, -0.1990, 1.0845]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(res.returns, raw.returns)


def test_gae_skips_masked_positions():
    # an observation token at t=1 (mask 0) with its own reward/value: the recursion jumps over it,
    # so the valid tokens get exactly the values of the 3-token case above
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.6, 0.7]])
    mask = torch.tensor([[True, False, True, True]])
    raw = compute_gae_advantages(
        token_rewards=rewards, response_mask=mask, values=values, gamma=0.9, lam=0.8, whiten=False
    )
    torch.testing.assert_close(raw.advantages, torch.tensor([[0.21712, 0.0, 0.246, 0.3]]))
    torch.testing.assert_close(raw.returns, torch.tensor([[0.71712, 0.0, 0.846, 1.0]]))


def test_gae_lam1_gamma1_equals_returns_minus_values():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 9, generator=g)
    values = torch.randn(6, 9, generator=g)
    mask = torch.rand(6, 9, generator=g) > 0.3
    raw = compute_gae_advantages(
        token_rewards=rewards, response_mask=mask, values=values, gamma=1.0, lam=1.0, whiten=False
    )
    # reward-to-go computed independently: reversed cumulative sum of the valid rewards
    to_go = torch.where(mask, rewards, 0.0).flip(-1).cumsum(-1).flip(-1)
    expected = torch.where(mask, to_go - values, 0.0)
    torch.testing.assert_close(raw.advantages, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(raw.returns, torch.where(mask, to_go, 0.0), atol=1e-5, rtol=0)


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantages(
            "gae",
            token_rewards=torch.zeros(1, 2),
            response_mask=torch.ones(1, 2).bool(),
            group_ids=torch.zeros(1).long(),
        )


def test_reinforce_discounted_returns_hand_computed():
    # row 0: rewards [0, 0, 1], gamma 0.5             -> G = [0.25, 0.5, 1]
    # row 1: same with an observation at t=1 (reward 7 ignored, no discount step) -> [0.25, 0, 0.5, 1]
    # row 2: reward 2 on a padding token is ignored   -> [1, 0, 0, 0]
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 7.0, 0.0, 1.0], [1.0, 0.0, 0.0, 2.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 0]]).bool()
    res = compute_advantages(
        "reinforce", token_rewards=rewards, response_mask=mask, group_ids=torch.arange(3), gamma=0.5
    )
    expected = torch.tensor([[0.25, 0.5, 1.0, 0.0], [0.25, 0.0, 0.5, 1.0], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(res.advantages, expected)
    torch.testing.assert_close(res.returns, expected)
    torch.testing.assert_close(compute_discounted_returns(rewards, mask, 0.5), expected)


def test_reinforce_plus_plus_hand_computed():
    # G (gamma 1): row 0 [1, 1], row 1 [0, -] (second token is padding)
    # valid G = [1, 1, 0]: mean 2/3, unbiased var ((1/3)^2 * 2 + (2/3)^2) / 2 = 1/3, std 0.57735
    # A = (G - 2/3) / 0.57735 = [0.57735, 0.57735, -1.15470]
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    res = compute_advantages(
        "reinforce_plus_plus", token_rewards=rewards, response_mask=mask, group_ids=torch.arange(2)
    )
    torch.testing.assert_close(res.advantages, torch.tensor([[0.57735, 0.57735], [-1.15470, 0.0]]))
    torch.testing.assert_close(res.returns, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


@pytest.mark.parametrize("name", ["grpo", "rloo"])
@pytest.mark.parametrize("norm", [True, False])
def test_group_normalised_advantages_have_zero_mean_per_group(name, norm):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(24, generator=g) * 3 + 1
    groups = torch.randint(0, 5, (24,), generator=g)
    rewards, mask = _outcome_batch(scores.tolist(), width=4)
    res = compute_advantages(
        name, token_rewards=rewards, response_mask=mask, group_ids=groups, norm_adv_by_std_in_grpo=norm
    )
    per_row = _row_values(res.advantages, mask)
    assert per_row.abs().sum() > 0
    sizes = {int(g): int((groups == g).sum()) for g in groups.unique()}
    assert min(sizes.values()) == 1 and max(sizes.values()) > 1  # both kinds of group are exercised
    for gid, size in sizes.items():
        if size > 1:  # a group of one keeps its own score (verl: baseline 0)
            assert abs(float(per_row[groups == gid].mean())) < 1e-5


@pytest.mark.parametrize("name", ALL_ESTIMATORS)
def test_masked_tokens_change_nothing(name):
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(8, 6, generator=g)
    values = torch.randn(8, 6, generator=g)
    mask = torch.rand(8, 6, generator=g) > 0.4
    mask[:, 0] = True
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    kwargs = dict(response_mask=mask, group_ids=groups, gamma=0.9, lam=0.95)
    base = compute_advantages(name, token_rewards=rewards, values=values, **kwargs)
    noise = torch.randn(8, 6, generator=g) * 100
    perturbed = compute_advantages(
        name,
        token_rewards=torch.where(mask, rewards, noise),
        values=torch.where(mask, values, -noise),
        **kwargs,
    )
    torch.testing.assert_close(perturbed.advantages, base.advantages)
    torch.testing.assert_close(perturbed.returns, base.returns)
    assert torch.all(base.advantages[~mask] == 0) and torch.all(base.returns[~mask] == 0)


def test_registry_extension_and_duplicate():
    @register_advantage_estimator("test_constant_one")
    def _constant(*, token_rewards, response_mask, **_):
        adv = response_mask.float()
        return AdvantageResult(adv, adv)

    try:
        mask = torch.tensor([[True, False]])
        res = compute_advantages(
            "test_constant_one",
            token_rewards=torch.zeros(1, 2),
            response_mask=mask,
            group_ids=torch.zeros(1).long(),
        )
        torch.testing.assert_close(res.advantages, torch.tensor([[1.0, 0.0]]))
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test_constant_one")(_constant)
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_constant_one")


def test_unknown_estimator_lists_known_names():
    with pytest.raises(ValueError, match="unknown advantage estimator 'grp0'.*gae.*grpo.*rloo"):
        compute_advantages(
            "grp0",
            token_rewards=torch.zeros(1, 2),
            response_mask=torch.ones(1, 2).bool(),
            group_ids=torch.zeros(1).long(),
        )


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantages(
            "grpo",
            token_rewards=torch.zeros(2, 3),
            response_mask=torch.ones(2, 2).bool(),
            group_ids=torch.zeros(2).long(),
        )
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(
            "grpo",
            token_rewards=torch.zeros(2, 3),
            response_mask=torch.ones(2, 3).bool(),
            group_ids=torch.zeros(3).long(),
        )
