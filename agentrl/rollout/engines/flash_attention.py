"""Attention of packed new tokens over the slot cache in place, through FlashAttention's varlen kernel.

A prefill over a cached history (an agent's next turn) used to pad its rows' queries to the widest row, gather
the rows' slots out of the cache (`index_select`, every layer) and call SDPA with an additive mask: on an H200
a 16-row extend forward spent 2.0 of its ~5 ms there. FlashAttention's varlen kernel reads keys and values where
they lie and takes the queries packed, with no mask.

The cache stays as the decode step wants it, (slots, kv heads, positions, head dim): each (slot, kv head) holds
its positions contiguously, so viewed as one run of (positions, 1 kv head, head dim) each (kv head, row) is one
sequence of a call, its keys starting where that (slot, kv head)'s positions do (`cu_k`) and `seqused` long. Two
calls, merged by their log-sum-exps: the row's tokens over the keys they wrote themselves, causal, under that kv
head's query heads (grouped-query attention in the kernel); and over the history before them, which every new
token sees whole, with the query heads as more query rows of one head (no causal mask to break), so a turn of
~50 tokens fills the kernel's 128-row tiles instead of leaving most of each empty.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch


@functools.cache
def _kernel_takes_seqused() -> bool:
    return "seqused_k" in str(torch.ops.aten._flash_attention_forward.default._schema)


def flash_cache_attention_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `flash_cache_attention` runs here: CUDA on Ampere or newer, half precision, and a PyTorch whose
    FlashAttention takes `seqused_k`."""
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and torch.cuda.get_device_capability(device)[0] >= 8
        and _kernel_takes_seqused()
    )


@dataclass
class FlashRows:
    """Where a forward's rows are in the cache, as the varlen kernel reads it (device tensors, int32), for its two
    calls: each row's new tokens over the keys they wrote (`own`, causal) and over the history cached before them
    (`history`, every key visible, so the kernel may take the kv head's query heads as more query rows).

    Sequence h x rows + r is row r under kv head h. Filled into fixed buffers (`fill_`), the same object serves a
    CUDA graph replay after replay."""

    cu_q: torch.Tensor
    """(kv_heads x rows + 1,) where each sequence's queries start in the (kv_heads x tokens) packed queries."""
    cu_k: torch.Tensor
    """(kv_heads x rows + 1,) where each sequence's own keys start in the cache viewed as one run of positions."""
    seqused: torch.Tensor
    """(kv_heads x rows,) each sequence's own keys: its new tokens."""
    history_cu_q: torch.Tensor
    """(kv_heads x rows + 1,) `cu_q` x groups: the queries with their group's heads as rows of one head."""
    history_cu_k: torch.Tensor
    """(kv_heads x rows + 1,) where each sequence's (slot, kv head) starts in the cache."""
    history_seqused: torch.Tensor
    """(kv_heads x rows,) the cached positions before each sequence's tokens."""
    max_q: int
    max_k: int
    groups: int
    """Query heads per kv head."""

    @staticmethod
    def host_arrays(
        slots: list[int], starts: list[int], lengths: list[int], kv_heads: int, length: int, groups: int
    ) -> torch.Tensor:
        """The six index tensors as one host int32 tensor (`own`'s cu_q, cu_k, seqused, then `history`'s): one
        copy to the device."""
        tokens = sum(lengths)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        cu_q = [h * tokens + c for h in range(kv_heads) for c in cu[:-1]] + [kv_heads * tokens]
        base = [(slot * kv_heads + h) * length for h in range(kv_heads) for slot in slots]
        own_k = [b + start for b, start in zip(base, starts * kv_heads, strict=True)] + [0]
        return torch.tensor(
            cu_q + own_k + lengths * kv_heads + [c * groups for c in cu_q] + base + [0] + starts * kv_heads,
            dtype=torch.int32,
        )

    @classmethod
    def empty(cls, sequences: int, max_q: int, max_k: int, groups: int, device: torch.device) -> FlashRows:
        """Buffers for `sequences` sequences, to `fill_` before each use."""

        def zeros(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=device)

        index = [zeros(n) for n in (sequences + 1, sequences + 1, sequences) * 2]
        return cls(*index, max_q, max_k, groups)

    def fill_(self, packed: torch.Tensor) -> None:
        """Copy `host_arrays`' tensor (already on the device) into these buffers."""
        buffers = (
            self.cu_q,
            self.cu_k,
            self.seqused,
            self.history_cu_q,
            self.history_cu_k,
            self.history_seqused,
        )
        for target, source in zip(buffers, packed.split([b.shape[0] for b in buffers]), strict=True):
            target.copy_(source)

    @classmethod
    def build(
        cls,
        slots: list[int],
        starts: list[int],
        lengths: list[int],
        kv_heads: int,
        length: int,
        groups: int,
        device: torch.device,
    ) -> FlashRows:
        """The rows' tensors, sized to them (no graph)."""
        max_k = max(s + n for s, n in zip(starts, lengths, strict=True))
        rows = cls.empty(kv_heads * len(slots), max(lengths), max_k, groups, device)
        rows.fill_(cls.host_arrays(slots, starts, lengths, kv_heads, length, groups).to(device))
        return rows


def merge_attention(
    own: torch.Tensor, own_lse: torch.Tensor, history: torch.Tensor, history_lse: torch.Tensor
) -> torch.Tensor:
    """Attention over two disjoint sets of keys, from each one's output (N, G, D) and log-sum-exp (N, G): the
    softmax over all keys weighs each part by its share of the exponentials. A part with no keys has a
    log-sum-exp of +inf from the kernel (its output 0): it weighs nothing."""
    history_lse = history_lse.nan_to_num(posinf=float("-inf"))
    top = torch.maximum(own_lse, history_lse)
    own_weight = (own_lse - top).exp().unsqueeze(-1)
    history_weight = (history_lse - top).exp().unsqueeze(-1)
    merged = own.float() * own_weight + history.float() * history_weight
    return (merged / (own_weight + history_weight)).to(own.dtype)


def flash_cache_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: FlashRows,
    scale: float,
    merge: Callable[..., torch.Tensor] = merge_attention,
) -> torch.Tensor:
    """Packed queries `q` (tokens, heads, D) attending causally over their rows' cache (slots, kv heads,
    positions, D), their own keys and values already written there; (tokens, heads, D).

    Two kernel calls, merged (`merge`): over the history every key is visible to every new token, so a kv head's
    query heads go in as query rows of one head (the kernel's tiles are 128 query rows: a 48-token turn filled
    48 of them per head, 7 x 48 fill 3 tiles); over the tokens' own keys, causal, a head each."""
    tokens, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    per_head = (
        q.view(tokens, kv_heads, groups, head_dim)
        .transpose(0, 1)
        .reshape(kv_heads * tokens, groups, head_dim)
    )
    k, v = keys.view(-1, 1, head_dim), values.view(-1, 1, head_dim)
    own, own_lse = varlen_kernel(
        per_head, k, v, rows.cu_q, rows.cu_k, rows.seqused, rows.max_q, rows.max_q, scale, causal=True
    )
    history, history_lse = varlen_kernel(
        per_head.view(-1, 1, head_dim), k, v, rows.history_cu_q, rows.history_cu_k, rows.history_seqused,
        rows.max_q * groups, rows.max_k, scale, causal=False,
    )  # fmt: skip
    out = merge(own, own_lse.t(), history.view_as(own), history_lse.view(-1, groups))
    return out.view(kv_heads, tokens, groups, head_dim).transpose(0, 1).reshape(tokens, heads, head_dim)


def varlen_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    seqused: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's varlen forward: sequence i's queries q[cu_q[i]:cu_q[i+1]] over keys
    k[cu_k[i]:cu_k[i]+seqused[i]] (causal from the bottom right, or not); the output (total_q, heads, D) and the
    log-sum-exp (heads, total_q). A module function: CPU tests put a reference of the same meaning here."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=seqused
    )
    return out, lse
