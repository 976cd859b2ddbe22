"""Attention of packed new tokens over the slot cache in place, through FlashAttention's varlen kernel.

A prefill over a cached history (an agent's next turn) used to pad its rows' queries to the widest row, gather
the rows' slots out of the cache (`index_select`, every layer) and call SDPA with an additive mask: on an H200
a 16-row extend forward spent 2.0 of its ~5 ms there. FlashAttention's varlen kernel reads keys and values where
they lie and takes the queries packed, with no mask.

The cache stays as the decode step wants it, (slots, kv heads, positions, head dim): each (slot, kv head) holds
its positions contiguously, so viewed as one run of (positions, 1 kv head, head dim) each (kv head, row) is one
sequence of the call, its keys starting at that (slot, kv head)'s first position (`cu_k`) and `seqused` long,
its queries that row's tokens under that kv head's query heads (grouped-query attention in the kernel). Causal
alignment is FlashAttention's for fewer queries than keys: a row's last token sees all its `seqused` keys.
"""

from __future__ import annotations

import functools
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
    """Where a forward's rows are in the cache, as the varlen kernel reads it (device tensors, int32).

    Sequence h x rows + r is row r under kv head h. Filled into fixed buffers (`fill_`), the same object serves a
    CUDA graph replay after replay."""

    cu_q: torch.Tensor
    """(kv_heads x rows + 1,) where each sequence's queries start in the (kv_heads x tokens) packed queries."""
    cu_k: torch.Tensor
    """(kv_heads x rows + 1,) where each sequence's keys start in the cache viewed as one run of positions."""
    seqused: torch.Tensor
    """(kv_heads x rows,) cached positions each sequence reads: its row's start + its new tokens."""
    max_q: int
    max_k: int

    @staticmethod
    def host_arrays(
        slots: list[int], starts: list[int], lengths: list[int], kv_heads: int, length: int
    ) -> torch.Tensor:
        """The three index tensors as one host int32 tensor (cu_q, cu_k, seqused): one copy to the device."""
        tokens = sum(lengths)
        cu, reach = [0], []
        for start, n in zip(starts, lengths, strict=True):
            cu.append(cu[-1] + n)
            reach.append(start + n)
        cu_q = [h * tokens + c for h in range(kv_heads) for c in cu[:-1]] + [kv_heads * tokens]
        cu_k = [(slot * kv_heads + h) * length for h in range(kv_heads) for slot in slots] + [0]
        return torch.tensor(cu_q + cu_k + reach * kv_heads, dtype=torch.int32)

    @classmethod
    def empty(cls, sequences: int, max_q: int, max_k: int, device: torch.device) -> FlashRows:
        """Buffers for `sequences` sequences, to `fill_` before each use."""

        def zeros(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=device)

        return cls(zeros(sequences + 1), zeros(sequences + 1), zeros(sequences), max_q, max_k)

    def fill_(self, packed: torch.Tensor) -> None:
        """Copy `host_arrays`' tensor (already on the device) into these buffers."""
        sequences = self.seqused.shape[0]
        parts = packed.split([sequences + 1, sequences + 1, sequences])
        for target, source in zip((self.cu_q, self.cu_k, self.seqused), parts, strict=True):
            target.copy_(source)

    @classmethod
    def build(
        cls,
        slots: list[int],
        starts: list[int],
        lengths: list[int],
        kv_heads: int,
        length: int,
        device: torch.device,
    ) -> FlashRows:
        """The rows' tensors, sized to them (no graph)."""
        max_k = max(s + n for s, n in zip(starts, lengths, strict=True))
        rows = cls.empty(kv_heads * len(slots), max(lengths), max_k, device)
        rows.fill_(cls.host_arrays(slots, starts, lengths, kv_heads, length).to(device))
        return rows


def flash_cache_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: FlashRows, scale: float
) -> torch.Tensor:
    """Packed queries `q` (tokens, heads, D) attending causally over their rows' cache (slots, kv heads,
    positions, D), their own keys and values already written there; (tokens, heads, D)."""
    tokens, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    per_head = (
        q.view(tokens, kv_heads, groups, head_dim)
        .transpose(0, 1)
        .reshape(kv_heads * tokens, groups, head_dim)
    )
    out = varlen_kernel(per_head, keys.view(-1, 1, head_dim), values.view(-1, 1, head_dim), rows, scale)
    return out.view(kv_heads, tokens, groups, head_dim).transpose(0, 1).reshape(tokens, heads, head_dim)


def varlen_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: FlashRows, scale: float
) -> torch.Tensor:
    """FlashAttention's varlen forward, causal, sequence i's queries q[cu_q[i]:cu_q[i+1]] over keys
    k[cu_k[i]:cu_k[i]+seqused[i]] (a module function: CPU tests put a reference of the same meaning here)."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, rows.cu_q, rows.cu_k, rows.max_q, rows.max_k, 0.0, True, False, scale=scale,
        seqused_k=rows.seqused,
    )[0]  # fmt: skip
