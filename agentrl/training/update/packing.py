"""Micro-batches: fixed row counts, or a token budget per micro-batch (`use_dynamic_bsz`).

Padding is removed per micro-batch: `TrainBatch.select` trims every micro-batch to its own longest row, so
short rows are never padded to the length of the longest row in the whole batch (`use_remove_padding`).
"""

from __future__ import annotations

import torch

from agentrl.training.update.assembly import TrainBatch


def split_mini_batches(
    batch_size: int, num_mini_batches: int, generator: torch.Generator | None, shuffle: bool
) -> list[torch.Tensor]:
    """Row indices of `num_mini_batches` near-equal mini-batches (shuffled when `shuffle`)."""
    order = torch.randperm(batch_size, generator=generator) if shuffle else torch.arange(batch_size)
    num = max(1, min(num_mini_batches, batch_size))
    return [chunk for chunk in torch.chunk(order, num) if len(chunk)]


def split_micro_batches(
    batch: TrainBatch,
    rows: torch.Tensor,
    *,
    micro_batch_size: int,
    use_dynamic_bsz: bool,
    max_token_len: int,
    remove_padding: bool = True,
) -> list[TrainBatch]:
    """Micro-batches of one mini-batch, each trimmed to its own longest row (`remove_padding`).

    With `use_dynamic_bsz`, rows are sorted by length and packed greedily so that rows * longest row stays
    within `max_token_len` tokens (a row longer than the budget goes alone).
    """
    if not use_dynamic_bsz:
        return [batch.select(chunk, trim=remove_padding) for chunk in torch.split(rows, micro_batch_size)]
    lengths = batch.attention_mask[rows].sum(dim=1)
    order = rows[torch.argsort(lengths, descending=True)]
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order.tolist():
        length = int(batch.attention_mask[index].sum())
        if current and max(longest, length) * (len(current) + 1) > max_token_len:
            groups.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return [batch.select(torch.tensor(g, dtype=torch.long), trim=remove_padding) for g in groups]
