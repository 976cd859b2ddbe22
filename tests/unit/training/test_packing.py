"""Mini- and micro-batches: fixed sizes, the dynamic token budget, trimming to the longest row."""

from __future__ import annotations

import torch

from agentrl.training.update.assembly import TrainingRow, rows_to_batch
from agentrl.training.update.packing import split_micro_batches, split_mini_batches

LENGTHS = [3, 10, 2, 8, 6]


def _batch(lengths=LENGTHS):
    rows = [
        TrainingRow(
            input_ids=[7] * n,
            response_mask=[0] + [1] * (n - 1),
            rollout_log_probs=[0.0] * n,
            reward=float(i),
            group_key="g",
            trajectory_key=str(i),
        )
        for i, n in enumerate(lengths)
    ]
    batch = rows_to_batch(rows, pad_token_id=0)
    batch["advantages"] = torch.arange(len(rows), dtype=torch.float32)[:, None].expand_as(batch.token_rewards)
    return batch


def test_dynamic_batches_respect_the_token_budget():
    batch = _batch()
    micros = split_micro_batches(
        batch, torch.arange(5), micro_batch_size=2, use_dynamic_bsz=True, max_token_len=16
    )
    # Longest first, greedily: [10] (10+8 would be 2*10), [8, 6] (2*8 = 16), [3, 2].
    assert [m.attention_mask.sum(dim=1).tolist() for m in micros] == [[10], [8, 6], [3, 2]]
    for micro in micros:
        assert micro.input_ids.numel() <= 16
    assert sorted(r for m in micros for r in m.rewards.tolist()) == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_row_over_the_budget_goes_alone():
    micros = split_micro_batches(
        _batch(), torch.arange(5), micro_batch_size=2, use_dynamic_bsz=True, max_token_len=5
    )
    assert [m.input_ids.shape for m in micros] == [(1, 10), (1, 8), (1, 6), (1, 3), (1, 2)]


def test_fixed_micro_batches_are_trimmed_to_their_longest_row():
    batch = _batch()
    assert batch.input_ids.shape == (5, 10)
    micros = split_micro_batches(
        batch, torch.tensor([0, 2, 3, 4]), micro_batch_size=2, use_dynamic_bsz=False, max_token_len=0
    )
    assert [m.input_ids.shape for m in micros] == [(2, 3), (2, 8)]
    # Extra tensors are cut with the rows and to the same length.
    assert micros[0]["advantages"].shape == (2, 3)
    assert micros[0]["advantages"][:, 0].tolist() == [0.0, 2.0]
    assert micros[1].response_mask.tolist()[0] == [False] + [True] * 7


def test_mini_batches_cover_every_row_once():
    generator = torch.Generator().manual_seed(0)
    minis = split_mini_batches(10, 3, generator, shuffle=True)
    assert [len(m) for m in minis] == [4, 4, 2]
    assert sorted(torch.cat(minis).tolist()) == list(range(10))
    ordered = split_mini_batches(4, 8, None, shuffle=False)
    assert [m.tolist() for m in ordered] == [[0], [1], [2], [3]]


def test_without_remove_padding_micro_batches_keep_the_batch_length():
    batch = _batch([3, 7, 2, 5])
    rows = torch.arange(4)
    kept = split_micro_batches(
        batch, rows, micro_batch_size=2, use_dynamic_bsz=False, max_token_len=0, remove_padding=False
    )
    trimmed = split_micro_batches(batch, rows, micro_batch_size=2, use_dynamic_bsz=False, max_token_len=0)
    assert [mb.input_ids.shape[1] for mb in kept] == [7, 7]
    assert [mb.input_ids.shape[1] for mb in trimmed] == [7, 5]
