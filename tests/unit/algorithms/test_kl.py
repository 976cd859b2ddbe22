"""KL estimators, the KL loss and KL-shaped rewards."""

import math

import pytest
import torch

from agentrl.algorithms import KL_TYPES, apply_kl_penalty_to_rewards, compute_kl_loss, compute_kl_penalty

LN2 = math.log(2)
# log pi = [ln .5, ln .25], log pi_ref = [ln .25, ln .5]  ->  d = log pi - log pi_ref = [ln 2, -ln 2]
LOGP = torch.tensor([[math.log(0.5), math.log(0.25)]])
REF = torch.tensor([[math.log(0.25), math.log(0.5)]])


@pytest.mark.parametrize(
    ("kl_type", "expected"),
    [
        ("kl", [LN2, -LN2]),
        ("k1", [LN2, -LN2]),
        ("abs", [LN2, LN2]),
        ("mse", [0.5 * LN2**2, 0.5 * LN2**2]),  # 0.240227
        ("k2", [0.5 * LN2**2, 0.5 * LN2**2]),
        # k3 = exp(-d) + d - 1: d=ln2 -> 0.5 + 0.693147 - 1 = 0.193147; d=-ln2 -> 2 - 0.693147 - 1 = 0.306853
        ("low_var_kl", [0.193147, 0.306853]),
        ("k3", [0.193147, 0.306853]),
    ],
)
def test_kl_types_hand_computed(kl_type, expected):
    assert kl_type in KL_TYPES
    torch.testing.assert_close(compute_kl_penalty(LOGP, REF, kl_type), torch.tensor([expected]))


def test_k3_is_clamped():
    # d = -50: exp(50) would be huge -> 10; d = +50: exp(-20 clamp) + 20 - 1 = 19 -> 10
    out = compute_kl_penalty(torch.tensor([[-50.0, 50.0]]), torch.zeros(1, 2), "low_var_kl")
    torch.testing.assert_close(out, torch.tensor([[10.0, 10.0]]))


def test_k3_never_negative():
    g = torch.Generator().manual_seed(6)
    for scale in (0.01, 1.0, 10.0, 100.0):
        logp = torch.randn(64, 32, generator=g) * scale
        ref = torch.randn(64, 32, generator=g) * scale
        k3 = compute_kl_penalty(logp, ref, "k3")
        assert torch.isfinite(k3).all()
        assert (k3 >= 0).all()
        assert (compute_kl_penalty(logp, ref, "k2") >= 0).all()


def test_unknown_kl_type_names_allowed():
    with pytest.raises(ValueError, match="unknown KL type 'k4'.*low_var_kl"):
        compute_kl_penalty(LOGP, REF, "k4")


def test_kl_loss_hand_computed():
    # k1 with the second token masked: token-mean = ln 2
    mask = torch.tensor([[True, False]])
    torch.testing.assert_close(compute_kl_loss(LOGP, REF, mask, kl_type="kl"), torch.tensor(LN2))
    # k3, both tokens: (0.193147 + 0.306853) / 2 = 0.25
    torch.testing.assert_close(
        compute_kl_loss(LOGP, REF, torch.ones(1, 2).bool(), kl_type="k3"),
        torch.tensor(0.25),
        atol=1e-5,
        rtol=0,
    )


def test_kl_penalty_to_rewards_hand_computed():
    # k1 = [[0.1, 0.2], [0.3, (masked)]], beta 0.5:
    # rewards = [[0 - 0.05, 1 - 0.1], [0 - 0.15, 2 (masked: unchanged)]]
    # kl_mean = mean over rows of row token-means = (0.15 + 0.3) / 2 = 0.225
    scores = torch.tensor([[0.0, 1.0], [0.0, 2.0]])
    logp = torch.tensor([[0.1, 0.2], [0.3, 9.0]])
    ref = torch.zeros(2, 2)
    mask = torch.tensor([[True, True], [True, False]])
    res = apply_kl_penalty_to_rewards(scores, logp, ref, mask, kl_coef=0.5, kl_type="kl")
    torch.testing.assert_close(res.token_rewards, torch.tensor([[-0.05, 0.9], [-0.15, 2.0]]))
    torch.testing.assert_close(res.kl_mean, torch.tensor(0.225))
