"""The Triton cache attention (`split_attention.py`) against FlashAttention's varlen kernel and a float32 reference,
at the head layouts of the models the engine serves. Run on the device machine (docs/development.md)."""

from __future__ import annotations

import pytest
import torch

from agentrl.rollout.engines._flash_extend import WIDTH, flash_sequences, packed_rows
from agentrl.rollout.engines.flash_attention import FlashRows, cache_view, varlen_kernel
from agentrl.rollout.engines.split_attention import (
    NARROW_HEADS,
    WIDE_HEADS,
    Launch,
    ranges_for,
    split_cache_attention,
)
from tests.unit.rollout.engines.test_slot_steps import reference_varlen_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)"),
]


HEAD_LAYOUTS = pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(14, 2, 64), (9, 3, 64), (12, 2, 128), (28, 4, 128), (4, 4, 64)],
    ids=["qwen2.5-0.5b", "smollm2-135m", "qwen2.5-1.5b", "qwen2.5-7b", "no-gqa"],
)
"""The head layouts of the models the engine serves (and one without grouping), for the Triton kernels' tests."""


def attention_case(heads: int, kv_heads: int, head_dim: int):
    """Next turns over histories of 0-2,000 cached positions, a first turn cut into sequences of `WIDTH`, a row of
    one token, and the padding's sequences: (q, keys, values, rows, scale), a float32 reference's output and
    FlashAttention's largest error from it per token."""
    torch.manual_seed(0)
    device, length, slots = torch.device("cuda"), 2048, 12
    keys = torch.randn(slots, kv_heads, length, head_dim, dtype=torch.bfloat16, device=device)
    values = torch.randn_like(keys)
    # a value that moves the output by ~0.06 where it is seen one position early (by the query at 1,086)
    values[1, :, 1087] = 64.0
    runs = [
        (3, 900, list(range(48))),
        (0, 1990, list(range(40))),
        (7, 0, list(range(300))),  # a first turn: five sequences of one slot, each causal up to its end
        (11, 511, [5]),
        (5, 64, list(range(64))),
        (9, 1200, list(range(17))),
        # keys 1,024-1,087 make one block, which holds the first query's (1,086) and the next query's own key
        (1, 1086, list(range(30))),
    ]
    tokens, bucket = 576, 8
    packed, sequences = packed_rows(runs, tokens, bucket, kv_heads, length, length - 1)
    rows = FlashRows.empty(flash_sequences(tokens, bucket), WIDTH, length, device)
    rows.fill_(sequences.to(device))
    q = torch.randn(tokens, heads, head_dim, dtype=torch.bfloat16, device=device)
    scale = head_dim**-0.5
    flash = varlen_kernel(q, cache_view(keys), cache_view(values), rows, scale).float()
    cpu_rows = FlashRows(*(t.cpu() for t in (rows.cu_q, rows.cu_k, rows.seqused)), rows.max_q, rows.max_k)
    reference = reference_varlen_kernel(
        q.float().cpu(), cache_view(keys.float().cpu()), cache_view(values.float().cpu()), cpu_rows, scale
    ).to(device)
    return (q, keys, values, rows, scale), reference, (flash - reference).abs().amax(dim=(1, 2))


def assert_as_close_as_flash(split: torch.Tensor, reference: torch.Tensor, flash_error: torch.Tensor) -> None:
    """Every output row no further from the reference than FlashAttention's (bf16 rounding of the inputs and
    output), the padding's rows finite."""
    assert split.isfinite().all()
    split_error = (split - reference).abs().amax(dim=(1, 2))
    assert (split_error <= 1.5 * flash_error + 2e-3).all(), (split_error.max(), flash_error.max())
    assert split_error.max() < 2e-2


@HEAD_LAYOUTS
def test_split_attention_matches_flash_attention_and_a_float32_reference(heads, kv_heads, head_dim):
    """The launch each head size gets, at every layout the engine serves."""
    inputs, reference, flash_error = attention_case(heads, kv_heads, head_dim)
    assert_as_close_as_flash(split_cache_attention(*inputs).float(), reference, flash_error)


@pytest.mark.parametrize(
    "launch",
    [
        Launch(2, 32, 3, 4),
        Launch(4, 64, 2, 8, block_m=128),
        Launch(3, 64, 1, 2, block_m=32),
        Launch(6, 32, 2, 4),
        Launch(4, 64, 2, 4, registers=96),
    ],
    ids=lambda launch: "-".join(map(str, launch)),
)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (12, 2, 128)], ids=["0.5b", "1.5b"])
def test_every_launch_setting_gives_the_same_attention(heads, kv_heads, head_dim, launch):
    """Launches other than the shipped ones (what `benchmarks/split_attention_settings.py` sweeps: ranges, keys a
    step, stages, warps, query rows a program, registers a thread) compute the same attention, so a sweep's timings compare like with
    like and a setting it finds can ship."""
    inputs, reference, flash_error = attention_case(heads, kv_heads, head_dim)
    assert_as_close_as_flash(split_cache_attention(*inputs, launch).float(), reference, flash_error)


def test_larger_forwards_split_their_keys_into_fewer_ranges():
    """The shipped launches' key ranges per sequence, on a GPU of 132 SMs (H100, H200): four for a forward of eight
    48-token next turns of the 0.5B layout, two from twelve (docs/benchmarks.md's sweep); a launch without a
    wave keeps its own."""
    device = torch.device("cuda")
    if torch.cuda.get_device_properties(device).multi_processor_count != 132:
        pytest.skip("the ranges are calibrated for 132 SMs")
    narrow = {tokens: ranges_for(NARROW_HEADS, tokens, 14, device) for tokens in (320, 384, 512, 576, 1536)}
    assert narrow == {320: 4, 384: 4, 512: 3, 576: 2, 1536: 2}
    assert [ranges_for(WIDE_HEADS, tokens, 12, device) for tokens in (384, 768)] == [3, 2]
    assert ranges_for(Launch(3, 64, 2, 4), 4096, 14, device) == 3
