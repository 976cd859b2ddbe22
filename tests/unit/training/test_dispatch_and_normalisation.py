"""Data-parallel dispatch round trip, and the loss normalised over the global mini-batch."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from agentrl.training.update.assembly import TrainingRow, rows_to_batch
from agentrl.training.update.ppo_update import run_ppo_updates
from agentrl.training.workers.dispatch import gather_outputs, split_batch


def _batch(lengths: list[int]):
    rows = [
        TrainingRow(
            input_ids=list(range(1, n + 1)),
            response_mask=[0] + [1] * (n - 1),
            rollout_log_probs=[0.0] * n,
            reward=float(i),
            group_key="g",
            trajectory_key=f"t{i}",
        )
        for i, n in enumerate(lengths)
    ]
    return rows_to_batch(rows, pad_token_id=0)


def test_split_pads_with_zero_weight_rows_and_gather_restores_batch_order():
    batch = _batch([3, 9, 5, 2, 7])
    shards, origin = split_batch(batch, 2, balance_tokens=True)
    assert [len(s) for s in shards] == [3, 3]  # 5 rows padded to 6
    assert sum(int(s.response_mask.sum()) for s in shards) == int(batch.response_mask.sum())
    outputs = [s.rewards.clone() for s in shards]
    assert torch.equal(gather_outputs(outputs, origin, len(batch)), batch.rewards)


def test_token_mean_loss_is_the_same_whatever_the_micro_batches():
    """Rows of 2 and 8 response tokens: with micro-batches of 1 row, the old per-row weighting gave the short
    row's tokens 4x the weight of the long row's; normalised globally, the gradient equals one big micro-batch."""
    batch = _batch([3, 9])
    torch.manual_seed(0)
    initial = torch.nn.Linear(1, 1, bias=False)
    grads = []
    for micro_size in (2, 1):
        net = copy.deepcopy(initial)

        def loss(micro, net=net):
            per_token = net.weight.squeeze() * micro.input_ids.float()
            mask = micro.response_mask
            return (per_token * mask).sum() / mask.sum(), {"actor/pg_loss": 0.0}

        section = SimpleNamespace(
            ppo_mini_batch_size=1, ppo_epochs=1, ppo_micro_batch_size_per_gpu=micro_size,
            use_dynamic_bsz=False, ppo_max_token_len_per_gpu=100, grad_clip=1e9, loss_agg_mode="token-mean",
        )  # fmt: skip
        optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        run_ppo_updates(
            batch, loss, model=net, optimizer=optimizer, scheduler=scheduler, generator=None, section=section,
            train_batch_size=1, shuffle=False, remove_padding=True, prefix="actor",
            on_optimizer_step=lambda net=net: grads.append(net.weight.grad.clone()),  # freed after the update
        )  # fmt: skip
        assert net.weight.grad is None
    assert torch.allclose(grads[0], grads[1])
