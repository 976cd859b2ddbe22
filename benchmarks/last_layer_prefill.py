"""The packed prefill with its last layer computed for every token or only for each row's last token
(`_slot_decode.TRIM_LAST_LAYER`), on the CPU.

Two measurements, the two forms taking turns in one process:

- the forward alone (`prefill_slots`): `--rows` rows of `--suffix` new tokens over a cached `--prefix`-token
  prefix of one of `--groups`, with the prefix read once a group as the engine reads it (`SharedPrefix`);
  medians of 5 runs of `--repeats` forwards, after checking both forms give the same logits;
- the embedded engine alone (no HTTP) on `benchmarks/serve_vs_vllm.py`'s workload, as
  `benchmarks/shared_prefix_decode.py` drives it: waves of `--rows` streamed requests, each one of the
  `--groups` prefixes plus `--suffix` tokens of its own, `--output` tokens out; mean time to first token and the
  wave's time (medians over `--waves` waves of each form after two unmeasured).

    python benchmarks/last_layer_prefill.py --threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from shared_prefix_decode import (
    add_workload_arguments,
    engine_waves,
)  # this folder is on the path when a benchmark runs as a script

from agentrl.models import load_causal_lm
from agentrl.rollout.engines import _slot_decode
from agentrl.rollout.engines._prefix_cache import BLOCK_TOKENS, block_hashes
from agentrl.rollout.engines._slot_decode import KVShape, prefill_slots
from agentrl.rollout.engines.shared_prefix_attention import plan_shared_prefix

FORMS = {"every token": False, "last tokens": True}


def forward_ms(args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds of one packed prefill forward in each form."""
    model = load_causal_lm(args.model)
    shape = KVShape.of(model)
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, 2000) for _ in range(args.prefix)] for _ in range(args.groups)]
    slots = args.groups + args.rows
    size = (slots, shape.kv_heads, args.prefix + args.suffix + 1, shape.head_dim)
    keys = [torch.zeros(size) for _ in range(shape.layers)]
    values = [torch.zeros(size) for _ in range(shape.layers)]
    prefill_slots(model, keys, values, list(range(args.groups)), [0] * args.groups, prefixes)
    group_of_row = [rng.randrange(args.groups) for _ in range(args.rows)]
    for cache in (
        keys + values
    ):  # each row's slot holds a copy of its group's prefix, as a parked one is copied
        cache[args.groups :, :, : args.prefix] = cache[group_of_row, :, : args.prefix]
    chunks = [[rng.randrange(10, 2000) for _ in range(args.suffix)] for _ in range(args.rows)]
    cached = [tuple(block_hashes(prefixes[g])[: args.prefix // BLOCK_TOKENS]) for g in group_of_row]
    shared = plan_shared_prefix(list(range(args.rows)), cached, args.rows, BLOCK_TOKENS, torch.device("cpu"))
    row_slots = list(range(args.groups, slots))

    def forward(trim: bool) -> torch.Tensor:
        _slot_decode.TRIM_LAST_LAYER = trim
        return prefill_slots(model, keys, values, row_slots, [args.prefix] * args.rows, chunks, shared=shared)

    torch.testing.assert_close(forward(True), forward(False), atol=1e-5, rtol=0)
    runs: dict[str, list[float]] = {name: [] for name in FORMS}
    for _ in range(5):
        for name, trim in FORMS.items():
            start = time.perf_counter()
            for _ in range(args.repeats):
                forward(trim)
            runs[name].append((time.perf_counter() - start) * 1000 / args.repeats)
    return {name: statistics.median(times) for name, times in runs.items()}


def _trims(trim: bool) -> Callable[[object], None]:
    def set_up(_: object) -> None:
        _slot_decode.TRIM_LAST_LAYER = trim

    return set_up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p)
    p.add_argument("--repeats", type=int, default=5, help="forwards a run of the forward alone")
    p.add_argument("--waves", type=int, default=12, help="engine: measured waves of each form")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # The engine first: torch calls on this thread before it made the engine's thread slower
    # (benchmarks/shared_prefix_decode.py).
    waves = engine_waves(args, {name: _trims(trim) for name, trim in FORMS.items()})
    forward = forward_ms(args)
    print(f"{args.model}, {args.threads} torch thread(s), {args.rows} rows of {args.suffix} new tokens")
    print("| | every token | last tokens only | ratio |\n| --- | ---: | ---: | ---: |")
    rows = [("prefill forward, ms", forward["every token"], forward["last tokens"])]
    rows += [
        (what, waves["every token"][i], waves["last tokens"][i])
        for i, what in enumerate(("engine: mean time to first token, ms", "engine: a wave, ms"))
    ]
    for what, whole, trimmed in rows:
        print(f"| {what} | {whole:.1f} | {trimmed:.1f} | {whole / trimmed:.2f}x |")


if __name__ == "__main__":
    main()
