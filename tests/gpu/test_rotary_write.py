"""The Triton kernel that rotates a packed prefill's queries and keys and writes keys and values into the slot cache
(`rotary_write.py`) against its documented meaning in plain torch (the reference the CPU suite runs in its place),
at the head layouts of the models the engine serves. Run on the device machine (docs/development.md)."""

from __future__ import annotations

import pytest
import torch

from agentrl.rollout.engines._flash_extend import cache_rows_of
from agentrl.rollout.engines.rotary_write import rotary_write
from tests.gpu.test_split_attention import HEAD_LAYOUTS, pytestmark  # noqa: F401 (pytest reads pytestmark)
from tests.unit.rollout.engines.test_slot_steps import reference_rotary_write


@HEAD_LAYOUTS
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

    expected_q = reference_rotary_write(qkv, biases, cos, sin, rows, expected_keys, expected_values, heads)

    step = 2**-7 if dtype == torch.bfloat16 else 1e-6  # one bf16 rounding step at magnitude ~1-2
    assert q.shape == (tokens, heads, head_dim)
    torch.testing.assert_close(q, expected_q, atol=4 * step, rtol=step)
    torch.testing.assert_close(keys, expected_keys, atol=4 * step, rtol=step)
    assert torch.equal(values, expected_values)
