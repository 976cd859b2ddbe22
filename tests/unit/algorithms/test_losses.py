"""Policy loss, value loss, aggregation modes, entropy and token log-probs."""

import math

import pytest
import torch

from agentrl.algorithms import (
    LOSS_AGG_MODES,
    aggregate_loss,
    compute_entropy_from_logits,
    compute_policy_loss,
    compute_token_log_probs,
    compute_value_loss,
)

# loss_mat rows [1,2,3], [4,5,6], [7,8,9]; mask keeps 2 tokens of row 0, 1 of row 1, none of row 2
LOSS_MAT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]]).bool()


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # rows sum to 3 and 4; the empty row is not counted: 7 / 2
        ("seq-mean-token-mean", 2.75),  # row means 1.5 and 4: 5.5 / 2
        ("seq-mean-token-sum-norm", 7 / 6),  # (3 + 4) / 2 rows / T=3
    ],
)
def test_aggregate_loss_modes_hand_computed(mode, expected):
    assert mode in LOSS_AGG_MODES
    torch.testing.assert_close(aggregate_loss(LOSS_MAT, MASK, mode), torch.tensor(expected))


def test_aggregate_loss_sum_norm_uses_given_constant():
    # (3 + 4) / 2 rows / 7 = 0.5, whatever the tensor's width
    torch.testing.assert_close(
        aggregate_loss(LOSS_MAT, MASK, "seq-mean-token-sum-norm", norm_length=7), torch.tensor(0.5)
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_loss_ignores_nan_under_mask(mode):
    poisoned = torch.where(MASK, LOSS_MAT, torch.tensor(float("nan")))
    torch.testing.assert_close(aggregate_loss(poisoned, MASK, mode), aggregate_loss(LOSS_MAT, MASK, mode))


def test_aggregate_loss_empty_mask_is_zero_and_unknown_mode_errors():
    assert float(aggregate_loss(LOSS_MAT, torch.zeros_like(MASK), "token-mean")) == 0.0
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token_mean'.*seq-mean-token-sum"):
        aggregate_loss(LOSS_MAT, MASK, "token_mean")


def _policy_case():
    # 4 valid tokens + 1 padding token with garbage values
    #   tok0: A=+1, rho=1.5: max(-1.5, -1.2) = -1.2         (PPO clip active)
    #   tok1: A=+1, rho=0.5: max(-0.5, -0.8) = -0.5
    #   tok2: A=-1, rho=5.0: max(5, 1.2) = 5 -> min(5, 3) = 3   (dual clip active)
    #   tok3: A=-1, rho=0.5: max(0.5, 0.8) = 0.8 -> min(0.8, 3) (PPO clip active)
    ratios = torch.tensor([[1.5, 0.5, 5.0, 0.5, 1.0]])
    old = torch.tensor([[-1.0, -2.0, -3.0, -0.5, 0.0]])
    log_probs = (old + ratios.log()).clone()
    log_probs[0, 4] = 50.0  # padding: would overflow exp without the mask
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1e6]])
    mask = torch.tensor([[True, True, True, True, False]])
    return log_probs, old, adv, mask


def test_policy_loss_hand_computed():
    log_probs, old, adv, mask = _policy_case()
    log_probs.requires_grad_(True)
    res = compute_policy_loss(
        log_probs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0
    )
    # token-mean: (-1.2 - 0.5 + 3 + 0.8) / 4 = 0.525
    torch.testing.assert_close(res.loss, torch.tensor(0.525))
    torch.testing.assert_close(res.clipfrac, torch.tensor(0.5))  # tok0, tok3
    torch.testing.assert_close(res.clipfrac_lower, torch.tensor(0.25))  # tok2
    # ppo_kl = mean(-log rho) = -ln(1.5 * 0.5 * 5 * 0.5) / 4 = -ln(1.875) / 4
    torch.testing.assert_close(res.ppo_kl, torch.tensor(-math.log(1.875) / 4))
    torch.testing.assert_close(res.ratio_mean, torch.tensor(1.875))  # (1.5 + 0.5 + 5 + 0.5) / 4
    # gradient: only tok1 is unclipped: d/dlogp (-A rho) / 4 = -0.5 / 4; clipped tokens get 0
    res.loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.0, -0.125, 0.0, 0.0, 0.0]]))
    assert not res.clipfrac.requires_grad


def test_policy_loss_clip_higher():
    # clip_ratio_high 0.6: tok0 (rho 1.5 < 1.6) is no longer clipped -> -1.5
    # loss = (-1.5 - 0.5 + 3 + 0.8) / 4 = 0.45; clipfrac 1/4 (tok3 only)
    log_probs, old, adv, mask = _policy_case()
    res = compute_policy_loss(log_probs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.6)
    torch.testing.assert_close(res.loss, torch.tensor(0.45))
    torch.testing.assert_close(res.clipfrac, torch.tensor(0.25))


def test_policy_loss_uses_agg_mode():
    # seq-mean-token-sum of the single row: -1.2 - 0.5 + 3 + 0.8 = 2.1
    log_probs, old, adv, mask = _policy_case()
    res = compute_policy_loss(log_probs, old, adv, mask, loss_agg_mode="seq-mean-token-sum")
    torch.testing.assert_close(res.loss, torch.tensor(2.1))


def test_dual_clip_bounds_loss_for_negative_advantages():
    g = torch.Generator().manual_seed(3)
    n = 200
    log_probs = torch.randn(n, generator=g) * 3
    old = torch.randn(n, generator=g) * 3
    adv = -torch.rand(n, generator=g) * 5 - 1e-3
    c = 3.0
    for i in range(n):
        res = compute_policy_loss(
            log_probs[i].view(1, 1),
            old[i].view(1, 1),
            adv[i].view(1, 1),
            torch.ones(1, 1).bool(),
            clip_ratio_c=c,
        )
        assert float(res.loss) <= float(-adv[i] * c) + 1e-5


def test_policy_loss_rejects_dual_clip_below_one():
    log_probs, old, adv, mask = _policy_case()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(log_probs, old, adv, mask, clip_ratio_c=1.0)


def test_value_loss_hand_computed():
    # cliprange 0.5
    #   tok0: V=1, V_old=0.5, R=2: V_clip=1.0; errs 1, 1      -> 1 (not clipped: equal)
    #   tok1: V=2, V_old=1,   R=0: V_clip=1.5; errs 4, 2.25   -> 4
    #   tok2: V=2, V_old=1,   R=3: V_clip=1.5; errs 1, 2.25   -> 2.25 (clipped is larger)
    # loss = 0.5 * (1 + 4 + 2.25) / 3 = 1.208333; clipfrac 1/3
    values = torch.tensor([[1.0, 2.0, 2.0, 100.0]], requires_grad=True)
    old = torch.tensor([[0.5, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 3.0, -100.0]])
    mask = torch.tensor([[True, True, True, False]])
    res = compute_value_loss(values, old, returns, mask, cliprange_value=0.5)
    torch.testing.assert_close(res.loss, torch.tensor(7.25 / 6))
    torch.testing.assert_close(res.clipfrac, torch.tensor(1 / 3))
    res.loss.backward()
    # d/dV of 0.5*(V-R)^2/3 for tok0, tok1; tok2 is clipped (constant); padding gets 0
    torch.testing.assert_close(values.grad, torch.tensor([[-1 / 3, 2 / 3, 0.0, 0.0]]))


def test_entropy_hand_computed():
    # [0, 0] -> ln 2; [0, ln 3] -> p = [1/4, 3/4], H = 0.25 ln 4 + 0.75 ln(4/3) = 0.562335
    # [1000, 1000] -> ln 2 without overflow
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3)], [1000.0, 1000.0]]])
    ent = compute_entropy_from_logits(logits)
    torch.testing.assert_close(ent, torch.tensor([[math.log(2), 0.562335, math.log(2)]]))


def test_entropy_matches_reference_with_chunking():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    ent = compute_entropy_from_logits(logits, chunk_size=4)
    ref = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(ent, ref)
    logits.requires_grad_(True)
    compute_entropy_from_logits(logits, chunk_size=4).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_token_log_probs_hand_computed():
    # logits [0, ln 3] -> p = [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)]]])
    lp = compute_token_log_probs(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.75), math.log(0.25)]]))


def test_token_log_probs_match_log_softmax_and_bf16():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 7, 13, generator=g) * 3
    ids = torch.randint(0, 13, (2, 7), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(compute_token_log_probs(logits, ids, chunk_size=3), ref)
    low = compute_token_log_probs(logits.bfloat16(), ids)
    assert low.dtype == torch.float32
    ref_low = torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(low, ref_low)
    with pytest.raises(ValueError, match="token_ids"):
        compute_token_log_probs(logits, ids[:, :3])
