"""The split cache attention's launch settings (`split_attention.py`) swept at the shapes the engine gives it, on a GPU:
key ranges per sequence, keys a step, pipeline stages, warps, query rows a program and registers a thread, for next
turns of 32-64 tokens over cached histories, laid out as the extend step lays them (`packed_rows`: tokens padded to
a multiple of `WIDTH`, rows to a power of two, the padding's sequences included). Each setting runs as one CUDA
graph of `--layers` calls, the partial kernel and the merge together, each call over a cache of its own as a
forward's layers read theirs: with `--one-cache` every call reads the same cache, which then stays in the GPU's L2
and favours settings that pipeline their loads less.

    python benchmarks/split_attention_settings.py --rows 4 8 12 16 24 32 --histories 600 1200
    python benchmarks/split_attention_settings.py --rows 8 16 32 --heads 12 --kv-heads 2 --head-dim 128

Prints one JSON line per (rows, history): the shipped setting's milliseconds (its key ranges as
`split_attention.ranges_for` picks them for the forward's tokens), the six fastest settings (splits, keys a step,
stages, warps, query rows, registers; each at a fixed number of ranges; ms; shipped / it; largest difference from
the shipped output) and the fastest time for each split count.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

import torch
from extend_attention import time_graph

from agentrl.rollout.engines import split_attention
from agentrl.rollout.engines._flash_extend import WIDTH, flash_sequences, packed_rows
from agentrl.rollout.engines.flash_attention import FlashRows
from agentrl.rollout.engines.split_attention import Launch


def launch(q, caches: list[tuple[torch.Tensor, torch.Tensor]], rows: FlashRows, setting: Launch):
    """A step that runs `split_cache_attention` with `setting` once per cache."""
    head_dim = q.shape[-1]

    def step() -> torch.Tensor:
        for keys, values in caches:
            out = split_attention.split_cache_attention(q, keys, values, rows, head_dim**-0.5, setting)
        return out

    return step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 12, 16, 24, 32])
    parser.add_argument(
        "--histories", type=int, nargs="+", default=[600, 1200], help="most cached tokens a row"
    )
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 3, 4, 6])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--warps", type=int, nargs="+", help="default: the shipped launch's")
    parser.add_argument("--block-m", type=int, nargs="+", help="query rows a program; default: the shipped's")
    parser.add_argument(
        "--registers",
        type=int,
        nargs="+",
        help="most registers a thread (0: the compiler's choice, the default)",
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--one-cache", action="store_true", help="every call reads the same cache")
    parser.add_argument("--slots", type=int, default=128)
    parser.add_argument("--length", type=int, default=2048, help="cache positions a slot holds")
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    shape = (args.slots, args.kv_heads, args.length, args.head_dim)
    distinct = 1 if args.one_cache else args.layers
    caches = [
        (torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype))
        for _ in range(distinct)
    ]
    caches = caches * (args.layers // distinct)
    first = split_attention.launch_for(args.head_dim)
    grid = (
        args.splits,
        args.block_n,
        args.stages,
        args.warps or [first.warps],
        args.block_m or [first.block_m],
        [r or None for r in args.registers or [0]],
    )
    settings = {*(Launch(*setting) for setting in itertools.product(*grid)), first}
    rng = random.Random(args.seed)
    device_name = torch.cuda.get_device_name(device)
    print(json.dumps({"device": device_name, "shipped": first, "caches": distinct, "layers": args.layers}))
    for count in args.rows:
        for history in args.histories:
            # slot 0 is the padding's: rows start at history / 2 .. history and add 32-64 tokens each
            runs = [
                (slot, rng.randint(history // 2, history), [1] * rng.randint(32, 64))
                for slot in rng.sample(range(1, args.slots), count)
            ]
            real = sum(len(ids) for _, _, ids in runs)
            tokens, bucket = -(-real // WIDTH) * WIDTH, 1 << (count - 1).bit_length()
            _, host = packed_rows(runs, tokens, bucket, args.kv_heads, args.length, args.length - 1)
            rows = FlashRows.empty(flash_sequences(tokens, bucket), WIDTH, args.length, device)
            rows.fill_(host.to(device))
            q = torch.randn(tokens, args.heads, args.head_dim, device=device, dtype=dtype)
            reference = launch(q, caches, rows, first)().float().clone()
            timed = {}
            for setting in sorted(settings, key=lambda s: [-1 if v is None else v for v in s]):
                step = launch(q, caches, rows, setting)
                difference = (step().float() - reference)[:real].abs().max().item()
                timed[setting] = (time_graph(step, 1, args.repeats), difference)
            shipped_ms = timed[first][0]
            fastest = sorted(timed.items(), key=lambda item: item[1][0])[:6]
            by_splits = {
                s: min(ms for (splits, *_), (ms, _) in timed.items() if splits == s) for s in args.splits
            }
            print(
                json.dumps(
                    {
                        "rows": count,
                        "history": history,
                        "tokens": real,
                        "shipped_ms": round(shipped_ms, 4),
                        "fastest": [
                            [list(s), round(ms, 4), round(shipped_ms / ms, 3), d] for s, (ms, d) in fastest
                        ],
                        "by_splits": {s: round(ms, 4) for s, ms in by_splits.items()},
                    }
                )
            )


if __name__ == "__main__":
    main()
