"""The packed tokens' queries, keys and values from their projection to the attention's inputs, in one kernel
(Triton): rotate the queries and keys, write keys and values into the slot cache, lay the queries out as the
attention kernel takes them.

Compiled, `flash_extend_step` spent four kernels a layer between the projections and the attention: the rotary of
the queries and of the keys (Inductor's fused kernels) and an indexed copy each for keys and values into the
cache (Inductor did not write the cache in place: it copied the whole cache and back), ~9 us a layer at an
agent's next-turn sizes, where the work is a few megabytes. One program here takes one token: its row of the
projection (queries, keys, values of every head side by side), its cos and sin, and where each kv head's key
and value go (`_flash_extend.cache_rows_of`). The arithmetic is the rotary's (x cos + rotate_half(x) sin) in
float32, rounded once, as Inductor computes it.
"""

from __future__ import annotations

import functools

import torch

from agentrl.rollout.engines.split_attention import triton_imports


def rotary_write_takes(attn: torch.nn.Module, head_dim: int, device: torch.device) -> bool:
    """Whether `rotary_write` serves this attention module: a CUDA device where Triton imports, plain linear
    projections (their weights concatenated into one multiply; biases on all three or none), no per-head norm
    (Qwen3's q_norm and k_norm run in the compiled projections instead) and a head size that is a power of two
    from 32 to 256."""
    linears = (attn.q_proj, attn.k_proj, attn.v_proj)
    plain = all(type(linear) is torch.nn.Linear for linear in linears)
    plain = plain and len({linear.bias is None for linear in linears}) == 1  # biases on all three or none
    normed = getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None
    sized = 32 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
    return device.type == "cuda" and plain and not normed and sized and triton_imports()


@functools.cache
def _kernel():  # noqa: ANN202 (Triton's JIT function, built on first use so that CPU hosts never import Triton)
    import triton
    import triton.language as tl

    @triton.jit
    def rotary_write(
        qkv_ptr, q_bias_ptr, k_bias_ptr, v_bias_ptr, cos_ptr, sin_ptr, cache_rows_ptr, keys_ptr, values_ptr,
        q_ptr,
        HAS_BIAS: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr,
        KV_HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        half: tl.constexpr = HEAD_DIM // 2
        dims = tl.arange(0, half)
        width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        row = qkv_ptr + token * width
        cos_low = tl.load(cos_ptr + token * HEAD_DIM + dims).to(tl.float32)
        cos_high = tl.load(cos_ptr + token * HEAD_DIM + half + dims).to(tl.float32)
        sin_low = tl.load(sin_ptr + token * HEAD_DIM + dims).to(tl.float32)
        sin_high = tl.load(sin_ptr + token * HEAD_DIM + half + dims).to(tl.float32)

        heads = tl.arange(0, HEADS_P2)
        head_ok = (heads < HEADS)[:, None]
        at = heads[:, None] * HEAD_DIM + dims[None, :]
        low = tl.load(row + at, mask=head_ok, other=0.0).to(tl.float32)
        high = tl.load(row + at + half, mask=head_ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            low += tl.load(q_bias_ptr + at, mask=head_ok, other=0.0).to(tl.float32)
            high += tl.load(q_bias_ptr + at + half, mask=head_ok, other=0.0).to(tl.float32)
        out = q_ptr + token * HEADS * HEAD_DIM + at
        kind = q_ptr.dtype.element_ty
        tl.store(out, (low * cos_low[None, :] - high * sin_low[None, :]).to(kind), mask=head_ok)
        tl.store(out + half, (high * cos_high[None, :] + low * sin_high[None, :]).to(kind), mask=head_ok)

        kv = tl.arange(0, KV_HEADS_P2)
        kv_ok = kv < KV_HEADS
        cache_at = tl.load(cache_rows_ptr + token * KV_HEADS + kv, mask=kv_ok, other=0)[:, None] * HEAD_DIM
        at = kv[:, None] * HEAD_DIM + dims[None, :]
        low = tl.load(row + HEADS * HEAD_DIM + at, mask=kv_ok[:, None], other=0.0).to(tl.float32)
        high = tl.load(row + HEADS * HEAD_DIM + at + half, mask=kv_ok[:, None], other=0.0).to(tl.float32)
        if HAS_BIAS:
            low += tl.load(k_bias_ptr + at, mask=kv_ok[:, None], other=0.0).to(tl.float32)
            high += tl.load(k_bias_ptr + at + half, mask=kv_ok[:, None], other=0.0).to(tl.float32)
        key_low = (low * cos_low[None, :] - high * sin_low[None, :]).to(keys_ptr.dtype.element_ty)
        key_high = (high * cos_high[None, :] + low * sin_high[None, :]).to(keys_ptr.dtype.element_ty)
        tl.store(keys_ptr + cache_at + dims[None, :], key_low, mask=kv_ok[:, None])
        tl.store(keys_ptr + cache_at + half + dims[None, :], key_high, mask=kv_ok[:, None])
        value_at = row + (HEADS + KV_HEADS) * HEAD_DIM + at
        for part in range(2):
            value = tl.load(value_at + part * half, mask=kv_ok[:, None], other=0.0)
            if HAS_BIAS:
                bias = tl.load(v_bias_ptr + at + part * half, mask=kv_ok[:, None], other=0.0)
                value = value.to(tl.float32) + bias.to(tl.float32)
            tl.store(
                values_ptr + cache_at + part * half + dims[None, :],
                value.to(values_ptr.dtype.element_ty),
                mask=kv_ok[:, None],
            )

    return rotary_write


def rotary_write(
    qkv: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """`qkv` (tokens, (heads + 2 kv heads) x D), the projections' output before their `biases` (query, key, value;
    added here: a bias concatenated for the multiply was one more copy a layer); `cos`, `sin` (tokens, D); keys
    and values written at `cache_rows` (tokens x kv heads,) of the cache viewed as (-1, D); the rotated queries,
    (tokens, heads, D)."""
    tokens = qkv.shape[0]
    _, kv_heads, _, head_dim = keys.shape
    if qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or not qkv.is_contiguous():
        raise ValueError(
            f"qkv of shape {tuple(qkv.shape)} is not {heads} + 2 x {kv_heads} heads of {head_dim}"
        )
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    q_bias, k_bias, v_bias = biases if biases is not None else (qkv, qkv, qkv)
    _kernel()[(tokens,)](
        qkv, q_bias, k_bias, v_bias, cos.contiguous(), sin.contiguous(), cache_rows, keys, values, q,
        HAS_BIAS=biases is not None, HEADS=heads, KV_HEADS=kv_heads,
        HEADS_P2=_power_of_two(heads), KV_HEADS_P2=_power_of_two(kv_heads), HEAD_DIM=head_dim, num_warps=2,
    )  # fmt: skip
    return q


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()
