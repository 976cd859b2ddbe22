"""attach_behaviour_weights: the off-policy weights of a whole batch, carried by its micro-batches into the loss."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from agentrl.algorithms import compute_policy_loss
from agentrl.training.update.assembly import TrainingRow, rows_to_batch
from agentrl.training.update.ppo_update import BEHAVIOUR_WEIGHTS, attach_behaviour_weights, run_ppo_updates


def _batch():
    """Row 0: prompt of 1 token, 2 response tokens; row 1: prompt of 1, 4 response tokens (one row padded)."""
    rows = [
        TrainingRow(
            input_ids=list(range(1, n + 2)),
            response_mask=[0] + [1] * n,
            rollout_log_probs=[0.0] + [-1.0] * n,
            reward=1.0,
            group_key="g",
            trajectory_key=f"t{i}",
        )
        for i, n in enumerate([2, 4])
    ]
    batch = rows_to_batch(rows, pad_token_id=0)
    # pi_old / pi_rollout: row 0 [1.5, 3], row 1 [0.5, 1, 2.5, 1]
    ratios = torch.ones(batch.input_ids.shape)
    ratios[0, 1:3] = torch.tensor([1.5, 3.0])
    ratios[1, 1:5] = torch.tensor([0.5, 1.0, 2.5, 1.0])
    batch["old_log_probs"] = batch.rollout_log_probs + ratios.log()
    return batch


def test_token_mode_stores_weights_and_returns_float_metrics():
    batch = _batch()
    metrics = attach_behaviour_weights(batch, "token", 2.0)
    mask = batch.response_mask
    torch.testing.assert_close(batch[BEHAVIOUR_WEIGHTS][mask], torch.tensor([1.5, 2.0, 0.5, 1.0, 2.0, 1.0]))
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx(8.0 / 6)
    assert metrics["rollout_corr/capped_frac"] == pytest.approx(2 / 6)
    assert metrics["rollout_corr/log_ratio_mean"] == pytest.approx(math.log(5.625) / 6, rel=1e-6)
    # micro-batches carry the rows' weights (cut to the micro-batch's width like every tensor)
    micro = batch.select(torch.tensor([0]))
    assert micro[BEHAVIOUR_WEIGHTS].shape == micro.input_ids.shape
    torch.testing.assert_close(micro[BEHAVIOUR_WEIGHTS][micro.response_mask], torch.tensor([1.5, 2.0]))


def test_sequence_mode_one_weight_per_row():
    batch = _batch()
    metrics = attach_behaviour_weights(batch, "sequence", 2.0)
    w = batch[BEHAVIOUR_WEIGHTS]
    # row 0: 1.5 * 3 = 4.5 -> 2; row 1: 0.5 * 1 * 2.5 * 1 = 1.25
    torch.testing.assert_close(w[0, 1:3], torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(w[1, 1:5], torch.tensor([1.25] * 4))
    assert metrics["rollout_corr/capped_frac"] == pytest.approx(0.5)


def test_mode_none_stores_nothing_but_reports_the_mismatch():
    batch = _batch()
    metrics = attach_behaviour_weights(batch, None, 2.0)
    assert BEHAVIOUR_WEIGHTS not in batch.tensors
    assert set(metrics) == {"rollout_corr/log_ratio_mean", "rollout_corr/kl_k3"}


def test_needs_old_log_probs():
    batch = _batch()
    del batch.tensors["old_log_probs"]
    with pytest.raises(ValueError, match="old_log_probs"):
        attach_behaviour_weights(batch, "token", 2.0)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_weighted_loss_is_the_same_whatever_the_micro_batches(mode):
    """The weights travel with their rows: one micro-batch of 2 rows or 2 of 1 give the same gradient."""
    batch = _batch()
    attach_behaviour_weights(batch, mode, 2.0)
    batch["advantages"] = torch.where(batch.response_mask, 1.0, 0.0)
    initial = torch.nn.Linear(1, 1, bias=False)
    grads = []
    for micro_size in (2, 1):
        net = copy.deepcopy(initial)

        def loss(micro, net=net):
            log_probs = micro["old_log_probs"] + net.weight.squeeze() * 0.1 * micro.input_ids.float()
            res = compute_policy_loss(
                log_probs, micro["old_log_probs"], micro["advantages"], micro.response_mask,
                behaviour_weights=micro[BEHAVIOUR_WEIGHTS],
            )  # fmt: skip
            return res.loss, {"actor/pg_loss": res.loss.item()}

        section = SimpleNamespace(
            ppo_mini_batch_size=1, ppo_epochs=1, ppo_micro_batch_size_per_gpu=micro_size,
            use_dynamic_bsz=False, ppo_max_token_len_per_gpu=100, grad_clip=1e9, loss_agg_mode="token-mean",
        )  # fmt: skip
        optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        run_ppo_updates(
            batch, loss, model=net, optimizer=optimizer, scheduler=scheduler, generator=None, section=section,
            train_batch_size=1, shuffle=False, remove_padding=True, prefix="actor",
            on_optimizer_step=lambda net=net: grads.append(net.weight.grad.clone()),
        )  # fmt: skip
    assert torch.allclose(grads[0], grads[1])
    assert float(grads[0].abs().sum()) > 0
