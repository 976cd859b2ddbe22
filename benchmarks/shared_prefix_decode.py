"""The CPU decode step and packed prefill with a prompt prefix their rows share read once
(`shared_prefix_attention.py`) or per row.

Three measurements, each form timed in alternating runs of one process:

- the decode attention alone: `--rows` rows in `--groups` groups over a `--prefix`-token shared prefix and
  `--own` positions of their own, at tiny:qwen2's head shape (2 kv heads of 2 query heads, head size 32), for
  `--layers` layers: the plain step's `decode_attention` over each row's slot against `SharedPrefix.attend`;
- the packed prefill's attention alone: `--rows` rows of `--suffix` new tokens over a cached `--prefix`-token
  prefix of one of `--groups` (the groups as drawn at random, as the engine's waves are), `--layers` layers: the
  plain prefill's gathered slots under one mask against `SharedPrefix.attend_prefill`;
- the embedded engine alone (no HTTP), on `benchmarks/serve_vs_vllm.py`'s workload: waves of `--rows` streamed
  requests, each one of `--groups` prefixes of `--prefix` tokens plus `--suffix` tokens of its own, `--output`
  tokens out, a wave sent once the last finished; time to first token and the wave's time (medians over
  `--waves` waves after two unmeasured), the prefix read once in both the prefill and the decode steps or in
  neither (`--decode-only`: in the prefill either way); the decode step plain or, `--compile-decode`, compiled
  as `agentrl serve` runs it.

    python benchmarks/shared_prefix_decode.py --threads 2
    python benchmarks/shared_prefix_decode.py --threads 1
    python benchmarks/shared_prefix_decode.py --threads 2 --compile-decode --decode-only
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from agentrl.rollout.engines._prefix_cache import BLOCK_TOKENS, block_hashes
from agentrl.rollout.engines._slot_decode import decode_attention
from agentrl.rollout.engines.embedded import EmbeddedEngine, build_embedded_engine
from agentrl.rollout.engines.shared_prefix_attention import plan_shared_prefix
from agentrl.types import SamplingParams


def _time_forms(
    forms: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    repeats: int,
) -> dict[str, float]:
    """Milliseconds of each form over every layer's cache (medians of 5 runs of `repeats`, the forms taking turns),
    after checking that the shared form gives the plain one's output."""
    torch.testing.assert_close(forms["shared"](keys[0], values[0]), forms["plain"](keys[0], values[0]))
    runs: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(5):
        for name, form in forms.items():
            start = time.perf_counter()
            for _ in range(repeats):
                for k, v in zip(keys, values, strict=True):
                    form(k, v)
            runs[name].append((time.perf_counter() - start) * 1000 / repeats)
    return {name: statistics.median(times) for name, times in runs.items()}


def _caches(
    args: argparse.Namespace, reach: int, group_of_slot: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`--layers` layers' keys and values at tiny:qwen2's head shape, slot i's first `--prefix` positions those of
    the first slot of its group (`group_of_slot[i]`), as copies of a parked prefix are."""
    shape = (args.rows, 2, reach + 64, 32)
    keys = [torch.randn(shape) for _ in range(args.layers)]
    values = [torch.randn(shape) for _ in range(args.layers)]
    for cache in keys + values:
        cache[:, :, : args.prefix] = cache[group_of_slot, :, : args.prefix]
    return keys, values


def attention_ms(args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds of `--layers` layers' decode attention, plain and shared (medians of 5 runs of 100 steps)."""
    torch.manual_seed(0)
    rows, kv_heads, query_rows, head = args.rows, 2, 2, 32
    reach = args.prefix + args.own
    keys, values = _caches(args, reach, torch.arange(rows) % args.groups)
    prompts = [[g] * args.prefix for g in range(args.groups)]
    hashes = [tuple(block_hashes(prompts[r % args.groups] + [r] * BLOCK_TOKENS)) for r in range(rows)]
    plan = plan_shared_prefix(list(range(rows)), hashes, rows, BLOCK_TOKENS, torch.device("cpu"))
    assert plan is not None, "these rows share no prefix worth reading once"
    query = torch.randn(rows, kv_heads, query_rows, head)
    positions = torch.randint(reach - 32, reach, (rows,))
    visible = (torch.arange(reach) <= positions[:, None])[:, None, None, :]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    forms = {
        "plain": lambda k, v: decode_attention(query, k[:, :, :reach], v[:, :, :reach], mask, 0.17),
        "shared": lambda k, v: plan.attend(query, k, v, mask, 0.17),
    }
    return _time_forms(forms, keys, values, repeats=100)


def prefill_attention_ms(args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds of `--layers` layers' packed prefill attention, plain and shared (medians of 5 runs of 10)."""
    torch.manual_seed(0)
    rows, kv_heads, query_heads, head = args.rows, 2, 2, 32
    reach = args.prefix + args.suffix
    group_of_slot = torch.randint(0, args.groups, (rows,))
    keys, values = _caches(args, reach, group_of_slot)
    row_slots = torch.randperm(rows)
    prompts = [[g] * args.prefix for g in range(args.groups)]
    hashes = [tuple(block_hashes(prompts[group_of_slot[slot]])) for slot in row_slots.tolist()]
    plan = plan_shared_prefix(list(range(rows)), hashes, rows, BLOCK_TOKENS, torch.device("cpu"))
    assert plan is not None, "these rows share no prefix worth reading once"
    query = torch.randn(rows, kv_heads, query_heads * args.suffix, head)
    positions = args.prefix + torch.arange(args.suffix)
    visible = (torch.arange(reach) <= positions[:, None]).repeat(query_heads, 1)
    # materialized, as the engine's `_grouped_mask` makes it (one row of keys per query row and row)
    mask = (
        torch.zeros(visible.shape)
        .masked_fill_(~visible, float("-inf"))
        .expand(rows, 1, *visible.shape)
        .contiguous()
    )
    own_mask = mask[..., args.prefix :].contiguous()

    def plain(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        gathered = (c[:, :, :reach].index_select(0, row_slots) for c in (k, v))
        return F.scaled_dot_product_attention(query, *gathered, attn_mask=mask, scale=0.17)

    forms = {
        "plain": plain,
        "shared": lambda k, v: plan.attend_prefill(query, k, v, own_mask, 0.17, row_slots),
    }
    return _time_forms(forms, keys, values, repeats=10)


async def _wave(engine: EmbeddedEngine, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    async def one(prompt: list[int]) -> float:
        start, first = time.perf_counter(), None
        async for _ in engine.stream(prompt, params):
            first = first or time.perf_counter() - start
        return first

    return await asyncio.gather(*(one(p) for p in prompts))


def engine_waves(
    args: argparse.Namespace, forms: dict[str, Callable[[EmbeddedEngine], None]]
) -> dict[str, tuple[float, float]]:
    """(median of the waves' mean time to first token ms, median wave ms) for each form, which sets the engine up
    before each of its waves (the forms take turns, two unmeasured waves first)."""
    engine = build_embedded_engine(
        args.model, max_model_len=1024, max_num_seqs=args.rows, compile_decode=args.compile_decode
    )
    rng = random.Random(1)
    vocab = min(engine.vocab_size, 2000)
    prefixes = [[rng.randrange(10, vocab) for _ in range(args.prefix)] for _ in range(args.groups)]
    params = SamplingParams(max_tokens=args.output, ignore_eos=True)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in forms}

    async def waves() -> None:
        for wave in range(2 + len(forms) * args.waves):
            name = list(forms)[wave % len(forms)]
            forms[name](engine)
            prompts = [
                rng.choice(prefixes) + [rng.randrange(10, vocab) for _ in range(args.suffix)]
                for _ in range(args.rows)
            ]
            start = time.perf_counter()
            firsts = await _wave(engine, prompts, params)
            if wave >= 2:
                results[name].append((statistics.mean(firsts) * 1000, (time.perf_counter() - start) * 1000))

    try:
        asyncio.run(waves())
    finally:
        engine.close()
    return {
        name: (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
        for name, runs in results.items()
    }


def _shares_prefixes(shared: bool, decode_only: bool) -> Callable[[EmbeddedEngine], None]:
    """The engine's rows read their shared prefixes once (`shared`) or each row its own copy; with `decode_only`
    the prefill reads them once either way, and only the decode step differs."""

    def set_up(engine: EmbeddedEngine) -> None:
        batch = engine._batch
        if not decode_only:
            batch._shares_prefixes = shared
        elif shared:
            batch.__dict__.pop("_shared_prefix", None)  # the class's planning again
        else:
            batch._shared_prefix = lambda bucket: None

    return set_up


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The serving workload's flags (`benchmarks/serve_vs_vllm.py`'s): the model, torch threads, `--rows` rows in
    `--groups` groups over a `--prefix`-token prefix, `--suffix` tokens of their own, `--output` tokens out."""
    p.add_argument("--model", default="tiny:qwen2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--suffix", type=int, default=64, help="engine: prompt tokens past the prefix")
    p.add_argument("--output", type=int, default=32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p)
    p.add_argument(
        "--own", type=int, default=96, help="attention alone: positions past the prefix a row holds"
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--waves", type=int, default=12, help="engine: measured waves of each form")
    p.add_argument(
        "--compile-decode",
        action="store_true",
        help="engine: the decode step through torch.compile, as `agentrl serve` runs it (default: the plain step)",
    )
    p.add_argument(
        "--decode-only",
        action="store_true",
        help="engine: both forms' prefills read a shared prefix once; only their decode steps differ",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # The engine first: torch calls on this thread before it made the engine's thread ~1.5x slower.
    waves = engine_waves(
        args,
        {
            "plain": _shares_prefixes(False, args.decode_only),
            "shared": _shares_prefixes(True, args.decode_only),
        },
    )
    attention = attention_ms(args)
    prefill = prefill_attention_ms(args)
    print(
        f"{args.threads} torch thread(s), {args.rows} rows in {args.groups} groups over {args.prefix} shared tokens"
    )
    print("| | plain | shared prefix read once | plain / shared |\n| --- | ---: | ---: | ---: |")
    print(
        f"| decode attention, {args.layers} layers, ms a step | {attention['plain']:.3f} | {attention['shared']:.3f} | "
        f"{attention['plain'] / attention['shared']:.2f}x |"
    )
    print(
        f"| prefill attention, {args.layers} layers, ms a forward | {prefill['plain']:.3f} | "
        f"{prefill['shared']:.3f} | {prefill['plain'] / prefill['shared']:.2f}x |"
    )
    engine = f"engine ({'compiled' if args.compile_decode else 'plain'} decode step{', decode only' if args.decode_only else ''})"
    for i, what in enumerate((f"{engine}: mean time to first token, ms", f"{engine}: a wave, ms")):
        plain, shared = waves["plain"][i], waves["shared"][i]
        print(f"| {what} | {plain:.1f} | {shared:.1f} | {plain / shared:.2f}x |")
    rate = {form: args.rows / (waves[form][1] / 1000) for form in waves}
    print(
        f"| {engine}: requests/s | {rate['plain']:.1f} | {rate['shared']:.1f} | {rate['shared'] / rate['plain']:.2f}x |"
    )


if __name__ == "__main__":
    main()
