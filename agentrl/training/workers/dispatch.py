"""Data-parallel dispatch: split a TrainBatch over the ranks of a worker group, and put results back.

Every rank gets the same number of rows, so every rank runs the same number of forward passes (FSDP's
collectives would otherwise wait forever). When the batch does not divide, it is padded with copies of
row 0 whose response mask is all False: they weigh nothing in any loss and their outputs are dropped.
With `balance_tokens` rows are dealt longest first to the rank with the fewest tokens so far (verl's
sequence-length balancing), else each rank takes a contiguous slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agentrl.training.update.assembly import _FIELDS as BATCH_FIELDS
from agentrl.training.update.assembly import TrainBatch


def padded_batch(batch: TrainBatch, multiple: int) -> TrainBatch:
    """`batch` with zero-weight copies of row 0 appended until its size is a multiple of `multiple`."""
    missing = -len(batch) % multiple
    if not missing:
        return batch
    pad = batch.select(torch.zeros(missing, dtype=torch.long), trim=False)
    pad.response_mask = torch.zeros_like(pad.response_mask)
    pad.token_rewards = torch.zeros_like(pad.token_rewards)
    return concat_batches([batch, pad])


def concat_batches(parts: Sequence[TrainBatch]) -> TrainBatch:
    """Rows of `parts` in order, right-padded to the longest (padding ids are masked out anyway)."""
    length = max(p.input_ids.shape[1] for p in parts)

    def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
        if tensors[0].dim() != 2:
            return torch.cat(tensors)
        return torch.cat([torch.nn.functional.pad(t, (0, length - t.shape[1])) for t in tensors])

    fields = {name: cat([getattr(p, name) for p in parts]) for name in BATCH_FIELDS}
    tensors = {key: cat([p.tensors[key] for p in parts]) for key in parts[0].tensors}
    images = [x for p in parts for x in (p.multi_modal_inputs or [None] * len(p))]
    return TrainBatch(**fields, tensors=tensors, multi_modal_inputs=images if any(images) else None)


def rank_rows(batch: TrainBatch, ranks: int, balance_tokens: bool) -> list[torch.Tensor]:
    """Row indices of each rank; `len(batch)` must be a multiple of `ranks` (see `padded_batch`)."""
    per_rank = len(batch) // ranks
    if not balance_tokens or ranks == 1:
        return list(torch.arange(len(batch)).split(per_rank))
    lengths = batch.attention_mask.sum(dim=1).tolist()
    order = sorted(range(len(batch)), key=lambda i: -lengths[i])
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    tokens = [0] * ranks
    for index in order:
        open_ranks = [r for r in range(ranks) if len(assigned[r]) < per_rank]
        target = min(open_ranks, key=lambda r: tokens[r])
        assigned[target].append(index)
        tokens[target] += lengths[index]
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in assigned]


def split_batch(batch: TrainBatch, ranks: int, balance_tokens: bool) -> tuple[list[TrainBatch], torch.Tensor]:
    """One shard per rank, and for every row of the concatenated shards its row in `batch` (-1: padding)."""
    size = len(batch)
    padded = padded_batch(batch, ranks)
    rows = rank_rows(padded, ranks, balance_tokens)
    origin = torch.cat(rows)
    origin = torch.where(origin < size, origin, torch.full_like(origin, -1))
    return [padded.select(r, trim=False) for r in rows], origin


def gather_outputs(outputs: Sequence[Any], origin: torch.Tensor, size: int) -> Any:
    """Put per-rank outputs back in batch order: (rows, ...) tensors, or dicts of them; padding dropped.

    Anything else (metrics already reduced over ranks inside the workers) is taken from rank 0.
    """
    first = outputs[0]
    if isinstance(first, dict) and all(isinstance(v, torch.Tensor) for v in first.values()):
        return {key: gather_outputs([o[key] for o in outputs], origin, size) for key in first}
    if not isinstance(first, torch.Tensor):
        return first
    length = max(o.shape[1] for o in outputs) if first.dim() == 2 else None
    parts = [
        torch.nn.functional.pad(o, (0, length - o.shape[1])) if length is not None else o for o in outputs
    ]
    stacked = torch.cat(parts)
    keep = origin >= 0
    result = torch.empty((size, *stacked.shape[1:]), dtype=stacked.dtype)
    result[origin[keep]] = stacked[keep]
    return result
