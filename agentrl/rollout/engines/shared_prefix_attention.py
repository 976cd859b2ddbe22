"""Decode attention that reads a prompt prefix shared by several rows once (the CPU's float32 decode step).

Rows whose prompts begin with the same tokens (a GRPO group's siblings, requests that share a system prompt or a
few-shot preamble) hold the same keys and values for those tokens, each slot its own copy. A decode step on the
CPU is bound by reading the cache: 32 rows over ~600 positions of which 512 are one of 4 prefixes read every
copy. Here each group of rows attends over its leader's copy of the prefix as one block of query rows (the
prefix is read once a group and stays in the CPU's caches), every row over its own positions past the prefix,
and the two softmaxes are merged by their maxima and sums: cascade attention, as FlashInfer and vLLM call it.

`benchmarks/shared_prefix_decode.py` times it against the plain step's attention, and the engine with and
without it. The result is the same attention up to float32 rounding (the summation is split in two): a row reads
its leader's keys for the prefix, computed from the same tokens at the same positions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

MIN_SHARED_TOKENS = 64
"""A shared prefix shorter than this is not worth the step's extra calls (~40 small ones a layer)."""


@dataclass(frozen=True)
class SharedPrefix:
    """How a decode step's slots share their first `length` cache positions."""

    length: int
    members: torch.Tensor
    """(groups, most members) long: the slots of each group, a shorter group padded with its first slot."""
    leaders: torch.Tensor
    """(groups,) long: the slot whose copy of the prefix its group reads."""
    member_of_slot: torch.Tensor
    """(slots of the step,) long: each slot's place in `members` flattened (a slot no row runs in: 0)."""
    sizes: tuple[int, ...]
    """Each group's slots (the members before its padding)."""

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention of `query` (slots, kv heads, query rows, D) over the first `mask.shape[-1]` positions of
        `keys`/`values` (every slot of the layer's cache), with the additive `mask` (slots, 1, 1, positions)."""
        slots, kv_heads, rows, head_dim = query.shape
        groups, most = self.members.shape
        length, reach = self.length, mask.shape[-1]
        grouped = (
            query.index_select(0, self.members.view(-1))
            .view(groups, most, kv_heads, rows, head_dim)
            .transpose(1, 2)
            .reshape(groups, kv_heads, most * rows, head_dim)
        )
        prefix_keys = keys[:, :, :length].index_select(0, self.leaders)
        prefix_values = values[:, :, :length].index_select(0, self.leaders)
        scores = torch.matmul(grouped, prefix_keys.transpose(-1, -2)).mul_(scale)
        shared = torch.cat(_partial_softmax(scores, prefix_values), dim=-1)
        shared = (
            shared.view(groups, kv_heads, most, rows, head_dim + 2)
            .transpose(1, 2)
            .reshape(groups * most, kv_heads, rows, head_dim + 2)
            .index_select(0, self.member_of_slot)
        )
        out_shared, max_shared, sum_shared = shared.split([head_dim, 1, 1], dim=-1)
        own_keys, own_values = keys[:slots, :, length:reach], values[:slots, :, length:reach]
        scores = torch.matmul(query, own_keys.transpose(-1, -2)).mul_(scale).add_(mask[..., length:])
        out_own, max_own, sum_own = _partial_softmax(scores, own_values)
        top = torch.maximum(max_shared, max_own)
        weight_shared, weight_own = (max_shared - top).exp_(), (max_own - top).exp_()
        total = (sum_shared * weight_shared).add_(sum_own * weight_own)
        return (out_shared * weight_shared).add_(out_own * weight_own).div_(total)

    def attend_prefill(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        own_mask: torch.Tensor,
        scale: float,
        row_slots: torch.Tensor,
    ) -> torch.Tensor:
        """A packed prefill's attention (`prefill_slots`), where this plan's slots are the forward's rows and
        `row_slots` (rows,) their cache slots. `query` (rows, kv heads, query rows, D): every query lies past
        the prefix, which every row holds already, so the prefix needs no mask; `own_mask` (rows, 1, query
        rows, positions past the prefix) additive. Both parts through the CPU's flash kernel, which gives the
        log-sum-exps the merge needs: a prefill's scores (a group's 1,024 query rows x 512 positions) are too
        many to hold as `attend` does."""
        _, kv_heads, query_rows, head_dim = query.shape
        length, reach = self.length, self.length + own_mask.shape[-1]
        leaders = row_slots.index_select(0, self.leaders)
        # A call per group, of its own rows only: one call over groups padded to the largest computed a
        # 13-row group's queries for every group.
        shared_parts = []
        for group, size in enumerate(self.sizes):
            members = self.members[group, :size]
            grouped = query.index_select(0, members).transpose(0, 1).reshape(1, kv_heads, -1, head_dim)
            leader = leaders[group : group + 1]
            out, lse = _flash_with_lse(
                grouped,
                keys[:, :, :length].index_select(0, leader),
                values[:, :, :length].index_select(0, leader),
                None,
                scale,
            )
            out = torch.cat((out, lse.unsqueeze(-1)), dim=-1)
            shared_parts.append(out.view(kv_heads, size, query_rows, head_dim + 1).transpose(0, 1))
        order = torch.cat([self.members[group, :size] for group, size in enumerate(self.sizes)])
        place = torch.empty_like(order)
        place[order] = torch.arange(len(order), device=order.device)
        out_shared, lse_shared = torch.cat(shared_parts).index_select(0, place).split([head_dim, 1], dim=-1)
        out_own, lse_own = _flash_with_lse(
            query,
            keys[:, :, length:reach].index_select(0, row_slots),
            values[:, :, length:reach].index_select(0, row_slots),
            own_mask,
            scale,
        )
        lse_own = lse_own.unsqueeze(-1)
        top = torch.maximum(lse_shared, lse_own)
        weight_shared, weight_own = (lse_shared - top).exp_(), (lse_own - top).exp_()
        total = weight_shared + weight_own
        return (out_shared * weight_shared).add_(out_own * weight_own).div_(total)


def _flash_with_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash attention, which `scaled_dot_product_attention` calls there, keeping the natural
    log-sum-exp of each query row's scores (batch, heads, query rows) that the public call drops."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, keys, values, attn_mask=mask, scale=scale
    )[:2]
    return out, lse


class SharedPrefixMask(NamedTuple):
    """What a decode step's layers read to know which positions each slot sees (`cache_attention`'s `visible`)
    when its slots share a prefix: the additive mask and how they share."""

    mask: torch.Tensor
    prefix: SharedPrefix


def _partial_softmax(
    scores: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax-weighted `values` before the division, with the maximum and the sum it needs to be merged.
    A row that sees no position here (an idle slot) gets zeros, not NaN: its maximum is clamped to a finite one."""
    top = scores.amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(scores.dtype).min)
    weights = scores.sub_(top).exp_()
    return torch.matmul(weights, values), top, weights.sum(dim=-1, keepdim=True)


def plan_shared_prefix(
    slots: list[int],
    prefixes: list[tuple[int, ...]],
    step_slots: int,
    block_tokens: int,
    device: torch.device,
) -> SharedPrefix | None:
    """How the running rows in `slots` should share a prefix in a decode step over slots 0..`step_slots`-1, or
    None when it would not pay. `prefixes[i]`: the chained block hashes of row i's prompt (`block_hashes`:
    equal i-th hashes mean equal first i+1 blocks of `block_tokens` tokens; empty: unknown, which rules sharing
    out while the row runs).

    The prefix length is the one that saves the most positions read (length x (rows - groups)) among the
    lengths every row's prompt reaches that are at least `MIN_SHARED_TOKENS` and leave groups of two rows on
    average. Rows sorted by their hashes put each group's rows next to each other, so the groups at a length
    are told apart by where neighbours' common prefixes end. Equal hashes are taken for equal tokens: unlike the
    prefix cache, which checks a match token by token, a collision of two running prompts' 64-bit hashes here
    would go unnoticed (vLLM's automatic prefix caching keys its blocks the same way)."""
    rows = len(slots)
    reach = min((len(p) for p in prefixes), default=0)
    if rows < 2 or reach * block_tokens < MIN_SHARED_TOKENS:
        return None
    order = sorted(range(rows), key=lambda i: prefixes[i][:reach])
    common = [_common_blocks(prefixes[a], prefixes[b], reach) for a, b in itertools.pairwise(order)]
    # Fewer groups at a length only where a neighbours' common prefix ends: the best length is one of those ends.
    worthwhile = [
        (blocks * (rows - groups), blocks)
        for blocks in {*common, reach}
        if blocks * block_tokens >= MIN_SHARED_TOKENS
        and 2 * (groups := 1 + sum(c < blocks for c in common)) <= rows
    ]
    if not worthwhile:
        return None
    _, best = max(worthwhile)
    groups_of: dict[int, list[int]] = {}
    for i in order:
        groups_of.setdefault(prefixes[i][best - 1], []).append(slots[i])
    return _plan(list(groups_of.values()), best * block_tokens, step_slots, device)


def _plan(groups: list[list[int]], length: int, step_slots: int, device: torch.device) -> SharedPrefix:
    """The plan of `groups` (each group's slots, its first the leader) sharing their first `length` positions,
    in a decode step over `step_slots` slots."""
    most = max(len(group) for group in groups)
    members = [group + [group[0]] * (most - len(group)) for group in groups]
    member_of_slot = [0] * step_slots
    for g, group in enumerate(groups):
        for j, slot in enumerate(group):
            member_of_slot[slot] = g * most + j
    return SharedPrefix(
        length=length,
        members=torch.tensor(members, dtype=torch.long, device=device),
        leaders=torch.tensor([group[0] for group in members], dtype=torch.long, device=device),
        member_of_slot=torch.tensor(member_of_slot, dtype=torch.long, device=device),
        sizes=tuple(len(group) for group in groups),
    )


def placeholder_plans(step_slots: int, block_tokens: int, device: torch.device) -> list[SharedPrefix]:
    """Plans over the first of `step_slots` slots that a compiled decode step is traced on before any request
    (`SlotBatch.compile_now`), so that no plan a real step makes compiles it again: two and three groups at
    two prefix lengths (the length then symbolic), and one group (a size of 1 is traced apart). No two sizes
    are equal: Dynamo would give them one symbol and compile again when they differ."""
    shapes = ((2, 3, 1), (3, 2, 2), (1, 5, 1))  # (groups, members each, prefix blocks)
    return [
        _plan(
            [list(range(g * most, (g + 1) * most)) for g in range(groups)],
            blocks * block_tokens,
            step_slots,
            device,
        )
        for groups, most, blocks in shapes
    ]


def _common_blocks(a: tuple[int, ...], b: tuple[int, ...], reach: int) -> int:
    """Leading blocks two prompts share (of their first `reach`), by bisection on the chained hashes."""
    low, high = 0, reach
    while low < high:
        middle = (low + high + 1) // 2
        if a[middle - 1] == b[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low
