"""An agent's next turns' attention over their cached histories, timed alone on a GPU: the extend step's
attention as it was (queries padded to the widest turn, the rows' slots gathered out of the cache, one SDPA call
with an additive mask), FlashAttention's varlen kernel reading the slot cache in place (`flash_attention.py`:
packed queries, no mask, no gather), and the Triton kernel that splits each row's keys and packs a kv head's
query heads (`split_attention.py`). Each runs as one CUDA graph of `--layers` calls, as a forward's layers do.

    python benchmarks/extend_attention.py --rows 8 16 32 64 --new 64 --history 900

`--decode-rows` also times a decode step's attention (one token a row, rows in slots 0..rows-1): SDPA with a mask
over the whole cache length, as `decode_step` reads it under CUDA graphs (one graph a bucket), against the
Triton kernel reading each row's own positions (a decode step through the flash step; measured and not kept,
docs/benchmarks.md):

    python benchmarks/extend_attention.py --rows --decode-rows 32 64 128 --history 1000 --length 2048

Prints one JSON line per row count: milliseconds a forward for each, the ratios and the largest difference of
each output from the padded SDPA's.
"""

from __future__ import annotations

import argparse
import functools
import json
import random

import torch
import torch.nn.functional as F

from agentrl.rollout.engines.flash_attention import (
    FlashRows,
    cache_view,
    flash_cache_attention_supported,
    varlen_kernel,
)
from agentrl.rollout.engines.split_attention import split_cache_attention


def gathered_attention(q_padded, keys, values, slot_ids, mask, span, scale):
    """The extend step's attention before: gather the rows' slots, one SDPA call with the additive mask."""
    rows, kv_heads = q_padded.shape[0], keys.shape[1]
    grouped = q_padded.reshape(rows, kv_heads, -1, q_padded.shape[-1])
    cached_keys = keys[:, :, :span].index_select(0, slot_ids)
    cached_values = values[:, :, :span].index_select(0, slot_ids)
    return F.scaled_dot_product_attention(grouped, cached_keys, cached_values, attn_mask=mask, scale=scale)


def time_graph(step, layers: int, repeats: int) -> float:
    """Milliseconds of one replay of a graph that calls `step` `layers` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def time_decode(args, keys, values, rng: random.Random) -> None:
    """One JSON line per `--decode-rows`: a decode step's attention through SDPA over the whole cache length
    (masked) and through the split kernel over each row's own positions."""
    device, dtype = keys.device, keys.dtype
    scale = args.head_dim**-0.5
    for rows in args.decode_rows:
        positions = [rng.randint(args.history // 3, args.history) for _ in range(rows)]
        at = torch.tensor(positions, device=device)
        visible = (torch.arange(args.length, device=device) <= at[:, None])[:, None, None, :]
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        q = torch.randn(
            rows, args.kv_heads, args.heads // args.kv_heads, args.head_dim, device=device, dtype=dtype
        )
        sdpa = functools.partial(
            F.scaled_dot_product_attention, q, keys[:rows], values[:rows], attn_mask=mask, scale=scale
        )
        plan = FlashRows.build(list(range(rows)), positions, [1] * rows, args.kv_heads, args.length, device)
        split = functools.partial(
            split_cache_attention, q.reshape(rows, args.heads, -1), keys, values, plan, scale
        )
        difference = (split().float() - sdpa().reshape(rows, args.heads, -1).float()).abs().max().item()
        sdpa_ms, split_ms = (time_graph(step, args.layers, args.repeats) for step in (sdpa, split))
        print(
            json.dumps(
                {
                    "case": "decode",
                    "rows": rows,
                    "cache_length": args.length,
                    "sdpa_whole_cache_ms": round(sdpa_ms, 3),
                    "split_ms": round(split_ms, 3),
                    "sdpa_over_split": round(sdpa_ms / split_ms, 2),
                    "max_abs_difference": difference,
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="*", default=[8, 16, 32, 64])
    parser.add_argument(
        "--decode-rows", type=int, nargs="*", default=[], help="decode steps of these many rows"
    )
    parser.add_argument("--new", type=int, default=64, help="most new tokens a row (each draws 1/2-1x of it)")
    parser.add_argument("--history", type=int, default=900, help="most cached tokens a row (1/3-1x of it)")
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--length", type=int, default=2048, help="cache positions a slot holds")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    print(
        json.dumps({"torch": torch.__version__, "supported": flash_cache_attention_supported(device, dtype)})
    )
    rng = random.Random(args.seed)
    shape = (args.slots, args.kv_heads, args.length, args.head_dim)
    keys = torch.randn(shape, device=device, dtype=dtype)
    values = torch.randn(shape, device=device, dtype=dtype)
    groups, scale = args.heads // args.kv_heads, args.head_dim**-0.5
    time_decode(args, keys, values, rng)
    for rows in args.rows:
        slots = rng.sample(range(args.slots), rows)
        starts = [rng.randint(args.history // 3, args.history) for _ in range(rows)]
        lengths = [rng.randint(args.new // 2, args.new) for _ in range(rows)]
        total, width = sum(lengths), max(lengths)
        span = 1 << (max(s + n for s, n in zip(starts, lengths, strict=True)) - 1).bit_length()
        q = torch.randn(total, args.heads, args.head_dim, device=device, dtype=dtype)
        # as the extend step builds them: padded queries (rows, heads, width, D), an additive mask per kv group
        row_of = torch.tensor([r for r, n in enumerate(lengths) for _ in range(n)], device=device)
        offset = torch.tensor([i for n in lengths for i in range(n)], device=device)
        padded = q.new_zeros(rows, width, args.heads, args.head_dim)
        padded[row_of, offset] = q
        padded = padded.transpose(1, 2).contiguous()
        query_positions = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)
        visible = torch.arange(span, device=device).view(1, 1, span) <= query_positions.unsqueeze(2)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        mask = mask.unsqueeze(1).expand(rows, groups, width, span).reshape(rows, 1, groups * width, span)
        slot_ids = torch.tensor(slots, device=device)
        plan = FlashRows.build(slots, starts, lengths, args.kv_heads, args.length, device)

        old = functools.partial(gathered_attention, padded, keys, values, slot_ids, mask, span, scale)
        flash = functools.partial(varlen_kernel, q, cache_view(keys), cache_view(values), plan, scale)
        split = functools.partial(split_cache_attention, q, keys, values, plan, scale)
        reference = (
            old().reshape(rows, args.heads, width, args.head_dim).transpose(1, 2)[row_of, offset].float()
        )
        old_ms, flash_ms, split_ms = (
            time_graph(step, args.layers, args.repeats) for step in (old, flash, split)
        )
        print(
            json.dumps(
                {
                    "rows": rows,
                    "tokens": total,
                    "span": span,
                    "gathered_sdpa_ms": round(old_ms, 3),
                    "flash_ms": round(flash_ms, 3),
                    "split_ms": round(split_ms, 3),
                    "flash_over_split": round(flash_ms / split_ms, 2),
                    "flash_max_abs_difference": (flash().float() - reference).abs().max().item(),
                    "split_max_abs_difference": (split().float() - reference).abs().max().item(),
                }
            )
        )


if __name__ == "__main__":
    main()
