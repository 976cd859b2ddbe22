"""Off-policy correction: truncated importance weights on the engine's log-probs, and the weighted PPO loss."""

import math

import pytest
import torch

from agentrl.algorithms import compute_policy_loss
from agentrl.algorithms.rollout_correction import TIS_MODES, behaviour_weights


def _case():
    """Two rows of the batch plus an empty one; ratios pi_old / pi_rollout and pi / pi_old set per token.

        row 0: mask [1, 1, 0]     pi_old/pi_rollout [1.5, 3.0, (e^50, padding)]   A [+1, -1, 1e6]   pi/pi_old [1.5, 0.5, .]
        row 1: mask [1, 1, 1]     pi_old/pi_rollout [0.5, 1.0, 2.5]               A [+1, -1, +1]    pi/pi_old [1.0, 1.0, 0.5]
        row 2: mask [0, 0, 0]     garbage everywhere (NaN log-probs)
    PPO clip 0.2, per token l = max(-A rho, -A clip(rho, 0.8, 1.2)):
        row 0: rho 1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped);  rho 0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped)
        row 1: -1.0 (rho 1, A=+1);  1.0 (rho 1, A=-1);  rho 0.5, A=+1: max(-0.5, -0.8) = -0.5 (unclipped)
    """
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5], [0.0, 0.0, 0.0]])
    behaviour_ratio = torch.tensor([[1.5, 3.0, 1.0], [0.5, 1.0, 2.5], [1.0, 1.0, 1.0]])
    old = rollout + behaviour_ratio.log()
    old[0, 2] = 47.0  # padding: old - rollout = 50, would be capped (and counted) if the mask leaked
    old[2] = float("nan")
    rho = torch.tensor([[1.5, 0.5, 1.0], [1.0, 1.0, 0.5], [1.0, 1.0, 1.0]])
    log_probs = old + rho.log()
    log_probs[2] = float("nan")
    adv = torch.tensor([[1.0, -1.0, 1e6], [1.0, -1.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    return log_probs, old, rollout, adv, mask


def _metrics(metrics):
    return {key: float(value) for key, value in metrics.items()}


def test_token_weights_and_metrics_hand_computed():
    _, old, rollout, _, mask = _case()
    weights, metrics = behaviour_weights(old, rollout, mask, "token", 2.0)
    # min(ratio, 2): row 0 [1.5, 2 (3 capped)], row 1 [0.5, 1, 2 (2.5 capped)]; 1 under the mask
    torch.testing.assert_close(weights, torch.tensor([[1.5, 2.0, 1.0], [0.5, 1.0, 2.0], [1.0, 1.0, 1.0]]))
    assert not weights.requires_grad
    m = _metrics(metrics)
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(7.0 / 5)  # (1.5 + 2 + 0.5 + 1 + 2) / 5 tokens
    assert m["rollout_corr/is_weight_max"] == pytest.approx(2.0)
    assert m["rollout_corr/capped_frac"] == pytest.approx(2 / 5)  # ratios 3 and 2.5 reach the cap
    # log-ratio mean: ln(1.5 * 3 * 0.5 * 1 * 2.5) / 5 = ln(5.625) / 5
    assert m["rollout_corr/log_ratio_mean"] == pytest.approx(math.log(5.625) / 5, rel=1e-6)
    # k3 = mean(rho - 1 - ln rho), rho = pi_old / pi_rollout: (sum(rho) - 5 - ln 5.625) / 5 = (3.5 - ln 5.625) / 5
    assert m["rollout_corr/kl_k3"] == pytest.approx((3.5 - math.log(5.625)) / 5, rel=1e-6)


def test_sequence_weights_and_metrics_hand_computed():
    _, old, rollout, _, mask = _case()
    weights, metrics = behaviour_weights(old, rollout, mask, "sequence", 2.0)
    # row 0: 1.5 * 3 = 4.5 -> capped at 2; row 1: 0.5 * 1 * 2.5 = 1.25 (the padding's e^50 is not in row 0's product)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 2.0, 1.0], [1.25, 1.25, 1.25], [1.0, 1.0, 1.0]]))
    m = _metrics(metrics)
    assert m["rollout_corr/is_weight_mean"] == pytest.approx((2.0 + 1.25) / 2)  # over the 2 non-empty rows
    assert m["rollout_corr/is_weight_max"] == pytest.approx(2.0)
    assert m["rollout_corr/capped_frac"] == pytest.approx(0.5)  # 1 row of 2
    assert m["rollout_corr/log_ratio_mean"] == pytest.approx(math.log(5.625) / 5, rel=1e-6)  # per token


def test_cap_not_hit():
    _, old, rollout, _, mask = _case()
    weights, metrics = behaviour_weights(old, rollout, mask, "token", 10.0)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 3.0, 1.0], [0.5, 1.0, 2.5], [1.0, 1.0, 1.0]]))
    m = _metrics(metrics)
    assert m["rollout_corr/capped_frac"] == 0.0
    assert m["rollout_corr/is_weight_max"] == pytest.approx(3.0)
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(8.5 / 5)
    weights, metrics = behaviour_weights(old, rollout, mask, "sequence", 10.0)
    torch.testing.assert_close(weights[:2, 0], torch.tensor([4.5, 1.25]))  # the true products
    assert float(metrics["rollout_corr/capped_frac"]) == 0.0


def test_cap_below_one_truncates_every_larger_weight():
    _, old, rollout, _, mask = _case()
    weights, metrics = behaviour_weights(old, rollout, mask, "token", 0.75)
    # ratios [1.5, 3] and [0.5, 1, 2.5]: all but 0.5 reach 0.75
    torch.testing.assert_close(weights[:2], torch.tensor([[0.75, 0.75, 1.0], [0.5, 0.75, 0.75]]))
    assert float(metrics["rollout_corr/capped_frac"]) == pytest.approx(4 / 5)


def test_token_mode_weighted_loss_hand_computed():
    log_probs, old, rollout, adv, mask = _case()
    log_probs.requires_grad_(True)
    weights, _ = behaviour_weights(old, rollout, mask, "token", 2.0)
    res = compute_policy_loss(log_probs, old, adv, mask, behaviour_weights=weights)
    # l = [-1.2, 0.8] and [-1, 1, -0.5], weighted by [1.5, 2] and [0.5, 1, 2]:
    #   -1.8 + 1.6 - 0.5 + 1.0 - 1.0 = -0.7; token-mean over 5 tokens = -0.14
    torch.testing.assert_close(res.loss, torch.tensor(-0.14))
    # the clip statistics are those of the unweighted loss: row 0's two tokens are clipped
    torch.testing.assert_close(res.clipfrac, torch.tensor(2 / 5))
    # gradient: only row 1's tokens are unclipped; d(-A rho)/dlogp = -A rho, times w, over 5 tokens:
    #   -1 * 0.5 / 5 = -0.1;  +1 * 1 / 5 = 0.2;  -0.5 * 2 / 5 = -0.2
    res.loss.backward()
    expected = torch.tensor([[0.0, 0.0, 0.0], [-0.1, 0.2, -0.2], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(torch.nan_to_num(log_probs.grad), expected)
    assert not torch.isnan(log_probs.grad[:2]).any()


def test_sequence_mode_weighted_loss_hand_computed():
    log_probs, old, rollout, adv, mask = _case()
    weights, _ = behaviour_weights(old, rollout, mask, "sequence", 2.0)
    res = compute_policy_loss(log_probs, old, adv, mask, behaviour_weights=weights)
    # row 0 x 2: -2.4 + 1.6 = -0.8; row 1 x 1.25: (-1 + 1 - 0.5) * 1.25 = -0.625; (-0.8 - 0.625) / 5 = -0.285
    torch.testing.assert_close(res.loss, torch.tensor(-0.285))
    # the weight multiplies before loss_agg_mode: seq-mean-token-mean = (-0.8 / 2 + -0.625 / 3) / 2 rows
    res = compute_policy_loss(
        log_probs, old, adv, mask, behaviour_weights=weights, loss_agg_mode="seq-mean-token-mean"
    )
    torch.testing.assert_close(res.loss, torch.tensor((-0.4 - 0.625 / 3) / 2))


def test_unweighted_loss_of_the_case_for_reference():
    log_probs, old, _, adv, mask = _case()
    # (-1.2 + 0.8 - 1 + 1 - 0.5) / 5 = -0.18
    torch.testing.assert_close(compute_policy_loss(log_probs, old, adv, mask).loss, torch.tensor(-0.18))


@pytest.mark.parametrize("mode", TIS_MODES)
def test_masked_tokens_are_ignored(mode):
    _, old, rollout, _, mask = _case()
    weights, metrics = behaviour_weights(old, rollout, mask, mode, 2.0)
    poisoned_old, poisoned_rollout = old.clone(), rollout.clone()
    poisoned_old[~mask] = float("inf")
    poisoned_rollout[~mask] = float("nan")
    weights2, metrics2 = behaviour_weights(poisoned_old, poisoned_rollout, mask, mode, 2.0)
    assert torch.equal(weights, weights2)
    assert _metrics(metrics) == _metrics(metrics2)
    assert torch.isfinite(weights2).all()


def test_mode_none_gives_no_weights_and_leaves_the_loss_exactly_as_before():
    g = torch.Generator().manual_seed(0)
    log_probs, old, rollout = (torch.randn(4, 6, generator=g) for _ in range(3))
    adv = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    weights, metrics = behaviour_weights(old, rollout, mask, None, 2.0)
    assert weights is None
    assert set(metrics) == {
        "rollout_corr/log_ratio_mean",
        "rollout_corr/kl_k3",
    }  # logged with tis_mode null too
    for mode in ("token-mean", "seq-mean-token-mean"):
        before = compute_policy_loss(log_probs, old, adv, mask, loss_agg_mode=mode)
        after = compute_policy_loss(log_probs, old, adv, mask, loss_agg_mode=mode, behaviour_weights=weights)
        for a, b in zip(before, after, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", TIS_MODES)
def test_engine_equal_to_trainer_is_a_no_op(mode):
    """pi_old == pi_rollout: every weight is exactly 1, so the loss is bit-identical, and k3 is 0."""
    g = torch.Generator().manual_seed(1)
    log_probs, old = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    weights, metrics = behaviour_weights(old, old.clone(), mask, mode, 2.0)
    assert torch.equal(weights, torch.ones_like(old))
    assert float(metrics["rollout_corr/kl_k3"]) == 0.0 and float(metrics["rollout_corr/capped_frac"]) == 0.0
    weighted = compute_policy_loss(log_probs, old, adv, mask, behaviour_weights=weights)
    assert torch.equal(weighted.loss, compute_policy_loss(log_probs, old, adv, mask).loss)


def test_kl_k3_is_accurate_for_tiny_gaps():
    """A healthy engine differs from the trainer by ~1e-4 nats: k3 ~ r^2 / 2, not float32 noise."""
    old = torch.full((1, 4), -1.0)
    rollout = old - 1e-4
    mask = torch.ones(1, 4, dtype=torch.bool)
    _, metrics = behaviour_weights(old, rollout, mask, None)
    assert float(metrics["rollout_corr/kl_k3"]) == pytest.approx(0.5e-8, rel=1e-2)
    assert float(metrics["rollout_corr/log_ratio_mean"]) == pytest.approx(1e-4, rel=1e-2)


def test_empty_mask_gives_zero_metrics_and_neutral_weights():
    old, rollout = torch.randn(2, 3), torch.randn(2, 3)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in TIS_MODES:
        weights, metrics = behaviour_weights(old, rollout, mask, mode, 2.0)
        assert torch.equal(weights, torch.ones(2, 3))
        assert all(float(v) == 0.0 for v in metrics.values())


def test_bad_arguments_are_refused():
    old = rollout = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"unknown tis_mode 'seq'.*algorithm.rollout_correction.tis_mode"):
        behaviour_weights(old, rollout, mask, "seq", 2.0)
    for cap in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="algorithm.rollout_correction.tis_cap"):
            behaviour_weights(old, rollout, mask, "token", cap)
    with pytest.raises(ValueError, match="rollout_log_probs has shape"):
        behaviour_weights(old, torch.zeros(1, 3), mask, "token", 2.0)
    with pytest.raises(ValueError, match="behaviour_weights has shape"):
        compute_policy_loss(old, old, old, mask, behaviour_weights=torch.ones(1, 3))
