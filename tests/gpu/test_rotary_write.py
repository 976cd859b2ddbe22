"""The Triton kernel that rotates a packed prefill's queries and keys and writes keys and values into the slot cache
(`rotary_write.py`) against the compiled path it replaces (the model's projections, `_rotate`, an indexed copy),
at the head layouts of the models the engine serves. Run on the device machine (docs/development.md)."""

from __future__ import annotations

import pytest
import torch

from agentrl.rollout.engines._flash_extend import cache_rows_of
from agentrl.rollout.engines._slot_decode import _rotate
from agentrl.rollout.engines.rotary_write import rotary_write

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)"),
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(14, 2, 64), (9, 3, 64), (12, 2, 128), (28, 4, 128), (4, 4, 64)],
    ids=["qwen2.5-0.5b", "smollm2-135m", "qwen2.5-1.5b", "qwen2.5-7b", "no-gqa"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("biased", [True, False], ids=["biases", "no-biases"])
def test_rotary_write_rotates_and_writes_what_the_projections_path_does(
    heads, kv_heads, head_dim, dtype, biased
):
    """Queries as the attention takes them, keys rotated and values at their cache rows (each with its
    projection's bias added, Qwen2's layout), nothing else of the cache touched: equal to the bias and the rotary
    computed in float32 and rounded once, within one rounding step."""
    torch.manual_seed(0)
    device, slots, length, tokens = torch.device("cuda"), 6, 300, 640
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    angles = torch.rand(tokens, head_dim // 2, device=device) * 300
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    order = torch.randperm(tokens, device=device)  # distinct (slot, position) pairs, in no order
    token_slots, positions = order % slots, order // slots

    keys = torch.randn(slots, kv_heads, length, head_dim, dtype=dtype, device=device)
    values = torch.randn_like(keys)
    expected_keys, expected_values = keys.clone(), values.clone()
    rows = cache_rows_of(token_slots, positions, keys)
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    biases = tuple(torch.randn(width, dtype=dtype, device=device) for width in widths) if biased else None

    q = rotary_write(qkv, biases, cos, sin, rows, keys, values, heads)

    q_part, k_part, v_part = qkv.float().split(widths, dim=-1)
    if biased:
        parts = zip((q_part, k_part, v_part), biases, strict=True)
        q_part, k_part, v_part = (part + bias.float() for part, bias in parts)
    wide_cos, wide_sin = cos.float()[:, None], sin.float()[:, None]
    expected_q = _rotate(q_part.view(tokens, heads, head_dim), wide_cos, wide_sin).to(dtype)
    rotated_keys = _rotate(k_part.view(tokens, kv_heads, head_dim), wide_cos, wide_sin).to(dtype)
    expected_keys.view(-1, head_dim).index_copy_(0, rows, rotated_keys.reshape(-1, head_dim))
    expected_values.view(-1, head_dim).index_copy_(0, rows, v_part.to(dtype).reshape(-1, head_dim))

    step = 2**-7 if dtype == torch.bfloat16 else 1e-6  # one bf16 rounding step at magnitude ~1-2
    assert q.shape == (tokens, heads, head_dim)
    torch.testing.assert_close(q, expected_q, atol=4 * step, rtol=step)
    torch.testing.assert_close(keys, expected_keys, atol=4 * step, rtol=step)
    assert torch.equal(values, expected_values)
