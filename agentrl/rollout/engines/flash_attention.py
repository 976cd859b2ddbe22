"""Attention of packed new tokens over the slot cache in place, through FlashAttention's varlen kernel.

A prefill over a cached history (an agent's next turn) used to pad its rows' queries to the widest row, gather
the rows' slots out of the cache (`index_select`, every layer) and call SDPA with an additive mask: on an H200
a 16-row extend forward spent 2.0 of its ~5 ms there. FlashAttention's varlen kernel reads keys and values where
they lie and takes the queries packed, with no mask.

The cache stays as the decode step wants it, (slots, kv heads, positions, head dim), and the kernel reads it
through a strided view, (runs, kv heads, head dim) with a position's stride D and a kv head's stride positions x D
(`cache_view`): run slot x kv heads x positions + p is position p of that slot, under every kv head. So each
row is one sequence of the call, its keys starting at its slot's first run (`cu_k`) and `seqused` long, its
queries its packed tokens under all query heads (grouped-query attention in the kernel; no copy of the queries
or the output into another layout). Causal alignment is FlashAttention's for fewer queries than keys: a row's
last token sees all its `seqused` keys.

Where Triton imports (every CUDA build of PyTorch), `flash_cache_attention` runs our kernel instead
(`split_attention.py`: the same rows, each sequence's keys split over several programs, 1.7-2.3x this kernel at
an agent's next-turn sizes on an H200); FlashAttention's stays for a PyTorch without Triton.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from agentrl.rollout.engines.split_attention import split_cache_attention, split_kernel_takes, triton_imports


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

    Filled into fixed buffers (`fill_`), the same object serves a CUDA graph replay after replay."""

    cu_q: torch.Tensor
    """(rows + 1,) where each sequence's queries start in the packed tokens."""
    cu_k: torch.Tensor
    """(rows + 1,) where each sequence's keys start among `cache_view`'s runs."""
    seqused: torch.Tensor
    """(rows,) cached positions each sequence reads: its row's start + its new tokens."""
    max_q: int
    max_k: int

    @staticmethod
    def host_arrays(
        slots: list[int], starts: list[int], lengths: list[int], kv_heads: int, length: int
    ) -> torch.Tensor:
        """The three index tensors as one host int32 tensor (cu_q, cu_k, seqused): one copy to the device."""
        cu_q = [0, *itertools.accumulate(lengths)]
        cu_k = [slot * kv_heads * length for slot in slots] + [0]
        reach = [start + n for start, n in zip(starts, lengths, strict=True)]
        return torch.tensor(cu_q + cu_k + reach, dtype=torch.int32)

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
        rows = cls.empty(len(slots), max(lengths), max_k, device)
        rows.fill_(cls.host_arrays(slots, starts, lengths, kv_heads, length).to(device))
        return rows


def cache_view(cache: torch.Tensor) -> torch.Tensor:
    """The (slots, kv heads, positions, D) cache as the kernel's keys or values, (runs, kv heads, D): run
    slot x kv heads x positions + p holds position p of that slot, kv head h at h x positions x D further on.
    The view ends (kv heads - 1) x positions runs early, where kv heads past the first would lie past the cache;
    no slot starts there."""
    slots, kv_heads, length, head_dim = cache.shape
    runs = (slots * kv_heads - kv_heads + 1) * length
    return cache.as_strided((runs, kv_heads, head_dim), (head_dim, length * head_dim, 1))


def flash_cache_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: FlashRows, scale: float
) -> torch.Tensor:
    """Packed queries `q` (tokens, heads, D) attending causally over their rows' cache (slots, kv heads,
    positions, D), their own keys and values already written there; (tokens, heads, D). Through
    `split_attention.split_cache_attention` where Triton is (every CUDA build of PyTorch brings it) and takes the
    head size, else FlashAttention's varlen kernel."""
    if q.is_cuda and split_attention_available() and split_kernel_takes(q.shape[-1]):
        return split_cache_attention(q, keys, values, rows, scale)
    return varlen_kernel(q, cache_view(keys), cache_view(values), rows, scale)


def split_attention_available() -> bool:
    """Whether Triton imports, for `split_cache_attention` (benchmarks/extend_attention.py sets it aside to time
    FlashAttention's kernel instead)."""
    return triton_imports()


def varlen_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: FlashRows, scale: float
) -> torch.Tensor:
    """FlashAttention's varlen forward, causal, sequence i's queries q[cu_q[i]:cu_q[i+1]] over keys
    k[cu_k[i]:cu_k[i]+seqused[i]] (a module function: CPU tests put a reference of the same meaning here)."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, rows.cu_q, rows.cu_k, rows.max_q, rows.max_k, 0.0, True, False, scale=scale,
        seqused_k=rows.seqused,
    )[0]  # fmt: skip
