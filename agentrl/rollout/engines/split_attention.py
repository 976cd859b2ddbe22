"""Attention of packed new tokens over the slot cache, split along the keys and grouped by kv head (Triton).

FlashAttention's varlen kernel gives each (sequence, query head) a block of 128 query rows and walks that
sequence's keys in one program: an agent's next turn of ~48 tokens fills 48 of the 128 rows, and its ~1,000
cached keys are eight steps one after another, so a 12-row forward of the 0.5B shape spent 51 us a layer there
(two fifths of the forward) for work an H200 does in a few. This kernel
- takes a kv head's query heads together as one block's rows (grouped-query attention packed: row r is token
  r // groups under query head r % groups of that kv head), so one load of a key block serves all of them;
- splits each sequence's keys into a few ranges (`ranges_for`: fewer for larger forwards, so that the programs
  stay within one wave of the GPU), each its own program, and merges their partial outputs by their log-sum-exps
  in a second kernel (what flash-decoding does for one query);
- walks the keys every query of the sequence sees (the history) in whole blocks without a mask, and only the
  rest (the turn's own keys, a range's ragged end) with the causal mask: a program's time is its steps one
  after another (~1.3 us per 64 keys on an H200), and a step without the mask's compares and selects is shorter
  (with the launches below, the engine's 0.5B prefill forwards 5-9% faster, docs/benchmarks.md).

It reads the same `FlashRows` as the varlen kernel and the cache where it lies, (slots, kv heads, positions, D):
sequence i's queries are q[cu_q[i]:cu_q[i+1]], its keys under kv head h the `seqused[i]` positions from flat
row cu_k[i] + h x positions, and query j sees the keys up to seqused[i] - n + j (causal from the bottom right).
Every token of q belongs to a sequence (`packed_rows` gives the padding sequences of its own), so every output
row is written.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from agentrl.rollout.engines.flash_attention import FlashRows

MIN_SPLIT_KEYS = 256
"""Keys a range holds at least: a sequence of fewer keys (a first turn's first sequences) runs in fewer programs,
whose partial outputs (float32, written and read again by the merge) cost more than its keys do."""


class Launch(NamedTuple):
    """How the partial kernel runs for one head size."""

    splits: int
    """Key ranges per sequence, at most (`ranges_for` picks fewer for larger forwards)."""
    block_n: int
    """Keys per step of a program."""
    stages: int
    """Triton's software pipeline stages (loads of the next key blocks in flight while one is computed)."""
    warps: int
    block_m: int = 64
    """Query rows (tokens x query heads of one kv head) per program."""
    registers: int | None = None
    """Most registers a thread may take (Triton's `maxnreg`), None: as many as the compiler picks."""
    wave: int = 0
    """Programs of this launch that one wave of a 132-SM GPU (H100, H200) runs, as calibrated by the sweeps
    (`ranges_for`); 0: always `splits` ranges (a benchmark's fixed setting)."""


NARROW_HEADS = Launch(splits=4, block_n=64, stages=3, warps=4, wave=360)
"""Heads of at most 64 (Qwen2.5-0.5B, SmolLM2). Swept (fifty-fourth session, H200, 6-32 next turns over 300-1,200
cached tokens, `benchmarks/split_attention_settings.py`): three stages nearly everywhere; four ranges fastest at 8
next turns of ~48 tokens over long histories (384 tokens a forward), three at 10, two from 12 (`wave`: 360
programs, about the three an SM holds at once, less each sequence's partly filled last query block)."""
WIDE_HEADS = Launch(splits=3, block_n=64, stages=3, warps=4, wave=264)
"""Heads over 64 wide (Qwen2.5-1.5B's and 7B's 128). With the history's blocks unmasked, 4 warps a program beat 8 at
every size swept (8-32 next turns over 600-1,200 cached tokens), steps of 64 keys beat 32 by 1.25x at 8 rows and
lost by more than 1.13x at 16 over short histories; three ranges fastest at 8 rows, two from 16 (`wave` 264: two
programs an SM, each holding three stages of 64 x 128 keys and values)."""


def launch_for(head_dim: int) -> Launch:
    """The partial kernel's launch for heads `head_dim` wide."""
    return NARROW_HEADS if head_dim <= 64 else WIDE_HEADS


def ranges_for(launch: Launch, tokens: int, heads: int, device: torch.device) -> int:
    """Key ranges per sequence for a forward of `tokens` tokens: as many as keep its programs (about tokens x heads
    / `block_m` query blocks, times the ranges) within one wave of the GPU, from 2 to `launch.splits`. A program's
    time is its steps one after another, so a second wave costs as much as the first, and fewer ranges than a
    wave holds leave SMs idle while each program takes more steps (docs/benchmarks.md)."""
    if not launch.wave:
        return launch.splits
    wave = launch.wave * _multiprocessors(device) / 132
    return max(2, min(launch.splits, int(wave * launch.block_m // (tokens * heads))))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def triton_imports() -> bool:
    """Whether Triton imports (every CUDA build of PyTorch brings it): the condition of this module's kernel and of
    `rotary_write.py`'s."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def split_kernel_takes(head_dim: int) -> bool:
    """Whether the kernel serves this head size: a power of two from 16 to 256 (its blocks span the head size
    whole; Qwen2.5, Llama and SmolLM2 have 64 or 128). Others (Phi-3's 96) take FlashAttention's kernel."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


@functools.cache
def _kernels():  # noqa: ANN202 (Triton's JIT functions, built on first use so that CPU hosts never import Triton)
    import triton
    import triton.language as tl

    @triton.jit
    def partial_attention(
        q_ptr, k_ptr, v_ptr, cu_q, cu_k, seqused, out_ptr, lse_ptr,
        scale, length, tokens,
        stride_qt, stride_qh,
        GROUPS: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, M_BLOCKS: tl.constexpr,
        SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr,
    ):  # fmt: skip
        sequence = tl.program_id(0) // M_BLOCKS
        m_block = tl.program_id(0) % M_BLOCKS
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        q_start = tl.load(cu_q + sequence)
        n = tl.load(cu_q + sequence + 1) - q_start
        if m_block * BLOCK_M >= n * GROUPS:
            return
        keys_used = tl.load(seqused + sequence)
        first_own = keys_used - n  # position of the sequence's first query
        key_base = tl.load(cu_k + sequence).to(tl.int64) + kv_head * length
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        token = rows // GROUPS
        head = kv_head * GROUPS + rows % GROUPS
        row_ok = token < n
        dims = tl.arange(0, HEAD_DIM)
        q_rows = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
        query_position = first_own + token
        per_split = tl.maximum(tl.cdiv(tl.cdiv(keys_used, SPLITS), BLOCK_N) * BLOCK_N, MIN_SPLIT_KEYS)
        begin = split * per_split
        end = tl.minimum(begin + per_split, keys_used)
        # Whole key blocks up to the first query's position: every query of the sequence sees all of them, so
        # they need no mask (the history, most of a next turn's keys); the rest (its own keys, a range's ragged
        # end) are masked.
        seen_by_all = begin + tl.maximum(tl.minimum(end, first_own + 1) - begin, 0) // BLOCK_N * BLOCK_N
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        scale_log2 = scale * 1.4426950408889634
        keys = tl.arange(0, BLOCK_N)
        for start in range(begin, seen_by_all, BLOCK_N):
            at = (key_base + start + keys)[:, None] * HEAD_DIM + dims[None, :]
            k = tl.load(k_ptr + at)
            v = tl.load(v_ptr + at)
            scores = tl.dot(q, tl.trans(k))
            new_top = tl.maximum(top, tl.max(scores, 1) * scale_log2)  # finite: no score is masked
            weights = tl.exp2(scores * scale_log2 - new_top[:, None])
            rescale = tl.exp2(top - new_top)
            total = total * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
            top = new_top
        for start in range(seen_by_all, end, BLOCK_N):
            positions = start + keys
            key_ok = positions < end
            at = (key_base + positions)[:, None] * HEAD_DIM + dims[None, :]
            k = tl.load(k_ptr + at, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_ptr + at, mask=key_ok[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale_log2
            seen = key_ok[None, :] & (positions[None, :] <= query_position[:, None])
            scores = tl.where(seen, scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)
            weights = tl.exp2(scores - safe_top[:, None])
            rescale = tl.exp2(top - safe_top)
            total = total * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v)
            top = new_top
        seen_any = total > 0
        out = acc / tl.where(seen_any, total, 1.0)[:, None]
        lse = tl.where(seen_any, top + tl.log2(tl.where(seen_any, total, 1.0)), float("-inf"))
        at = (split * tokens + q_start + token).to(tl.int64) * HEADS + head
        # An empty range writes only its log-sum-exp (-inf): the merge reads no output of it.
        tl.store(out_ptr + at[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None] & (begin < end))
        tl.store(lse_ptr + at, lse, mask=row_ok)

    @triton.jit
    def merge_splits(
        part_ptr, lse_ptr, out_ptr, tokens,
        HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, HEADS_P2)
        head_ok = heads < HEADS
        dims = tl.arange(0, HEAD_DIM)
        top = tl.full([HEADS_P2], float("-inf"), tl.float32)
        for split in range(SPLITS):
            lse = tl.load(
                lse_ptr + (split * tokens + token) * HEADS + heads, mask=head_ok, other=float("-inf")
            )
            top = tl.maximum(top, lse)
        safe_top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([HEADS_P2], tl.float32)
        acc = tl.zeros([HEADS_P2, HEAD_DIM], tl.float32)
        for split in range(SPLITS):
            at = (split * tokens + token) * HEADS + heads
            lse = tl.load(lse_ptr + at, mask=head_ok, other=float("-inf"))
            weight = tl.exp2(lse - safe_top)
            seen = (head_ok & (weight > 0))[:, None]
            part = tl.load(part_ptr + at[:, None] * HEAD_DIM + dims[None, :], mask=seen, other=0.0)
            acc += part * weight[:, None]
            total += weight
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        at = (token * HEADS + heads)[:, None] * HEAD_DIM + dims[None, :]
        tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])

    return partial_attention, merge_splits


def split_cache_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: FlashRows,
    scale: float,
    launch: Launch | None = None,
) -> torch.Tensor:
    """Packed queries `q` (tokens, heads, D) attending causally over their sequences' cache (slots, kv heads,
    positions, D), their own keys and values already written there; (tokens, heads, D). Sequences of at most
    `rows.max_q` tokens (`_flash_extend.WIDTH`). `launch`: the head size's own unless given (a benchmark's)."""
    partial_attention, merge_splits = _kernels()
    tokens, heads, head_dim = q.shape
    _, kv_heads, length, _ = keys.shape
    groups = heads // kv_heads
    sequences = rows.seqused.shape[0]
    launch = launch or launch_for(head_dim)
    splits = ranges_for(launch, tokens, heads, q.device)
    block_m = min(launch.block_m, max(16, _power_of_two(rows.max_q * groups)))  # sequences of one token: 16
    m_blocks = -(-rows.max_q * groups // block_m)
    parts = torch.empty(splits, tokens, heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(splits, tokens, heads, dtype=torch.float32, device=q.device)
    partial_attention[(sequences * m_blocks, kv_heads, splits)](
        q, keys, values, rows.cu_q, rows.cu_k, rows.seqused, parts, lse,
        scale, length, tokens, q.stride(0), q.stride(1),
        GROUPS=groups, HEADS=heads, HEAD_DIM=head_dim, M_BLOCKS=m_blocks, SPLITS=splits,
        BLOCK_M=block_m, BLOCK_N=launch.block_n, MIN_SPLIT_KEYS=MIN_SPLIT_KEYS,
        num_warps=launch.warps, num_stages=launch.stages,
        **({} if launch.registers is None else {"maxnreg": launch.registers}),
    )  # fmt: skip
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    merge_splits[(tokens,)](
        parts, lse, out, tokens,
        HEADS=heads, HEADS_P2=_power_of_two(heads), HEAD_DIM=head_dim, SPLITS=splits, num_warps=4,
    )  # fmt: skip
    return out


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()
