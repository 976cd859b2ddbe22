"""The embedded engine's prefill forward on a GPU, by its size: how its device time and tokens/s grow with the
rows and tokens one admission computes (agents' next turns over cached histories, and first turns).

Through the engine's slot cache as the engine drives it (`SlotBatch.admit`, CUDA graphs, compiled steps):
each (rows, new tokens) case prefills and parks fresh histories of `--history` / 2 to `--history` tokens, then
admits that many next turns of that many tokens each, `--repeats` times (each turn's history is the one before
plus its turn, parked again), and reads the forwards' device time off the engine's counters (timed from the graph
replay: captures and input copies are host work, not counted). A first-turn case (`--first`) admits fresh
prompts of that many tokens instead (no cached history).

    python benchmarks/prefill_forward.py --model tiny:qwen2.5-0.5b-shape --rows 4 8 16 32 64 --new 48 \\
        --first 256 [--attention flash] [--whole-last-layer] [--profile 12]

Prints one JSON line per case: rows, tokens a forward, forwards, milliseconds a forward, tokens/s. `--profile N`
also prints, for each case, the N kernels that took the most device time (`torch.profiler`, microseconds a
forward, launches a forward): where a forward's time goes, kernel by kernel.
"""

from __future__ import annotations

import argparse
import collections
import json
import random

import torch

from agentrl.models import load_causal_lm
from agentrl.rollout.engines import _slot_decode, flash_attention
from agentrl.rollout.engines._slot_batch import SlotBatch


def measured(batch: SlotBatch, admit) -> tuple[int, int, float]:
    """Forwards, tokens and device seconds of the prefill forwards `admit()` makes."""
    batch.settle_timings()
    before = {k: batch.counters[k] for k in ("prefill_forwards", "prefill_tokens", "prefill_s")}
    admit()
    batch.settle_timings()
    return tuple(batch.counters[k] - before[k] for k in before)


def kernel_table(profiler: torch.profiler.profile, forwards: int, top: int) -> tuple[float, list[dict]]:
    """Microseconds in kernels per forward over a profiled case (the admission's: its forwards' and the few after
    them that draw the first tokens; the forward's time beyond its own kernels is the gaps between them), and the
    `top` kernels by device time: name, microseconds and launches a forward."""
    spent: collections.Counter[str] = collections.Counter()
    launches: collections.Counter[str] = collections.Counter()
    for event in profiler.events():
        copy = event.name.startswith(("Memcpy", "Memset"))  # the inputs' copies: before the timed replay
        if event.device_type == torch.autograd.DeviceType.CUDA and not copy:
            spent[event.name] += event.device_time_total
            launches[event.name] += 1
    table = [
        {"kernel": name[:90], "us": round(us / forwards, 1), "launches": round(launches[name] / forwards, 1)}
        for name, us in spent.most_common(top)
    ]
    return round(sum(spent.values()) / forwards, 1), table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny:qwen2.5-0.5b-shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--new", type=int, default=48, help="tokens of each next turn")
    parser.add_argument("--history", type=int, default=900, help="cached tokens a row has (1/2-1x of it)")
    parser.add_argument("--first", type=int, default=0, help="also admit fresh prompts of this many tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attention",
        choices=["split", "flash"],
        default="split",
        help="the cache attention: the Triton split kernel (the engine's own where Triton is) or FlashAttention's",
    )
    parser.add_argument(
        "--whole-last-layer",
        action="store_true",
        help="compute the last layer for every token, not only each row's last (`_slot_decode.TRIM_LAST_LAYER`)",
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="print each case's N costliest kernels (0: none)"
    )
    args = parser.parse_args()
    _slot_decode.TRIM_LAST_LAYER = not args.whole_last_layer
    if args.attention == "flash":
        flash_attention.split_attention_available = lambda: False
    rng = random.Random(args.seed)
    model = load_causal_lm(args.model, dtype=args.dtype, device="cuda").eval()
    slots = 2 * max(args.rows)
    batch = SlotBatch(model, max_slots=slots, max_model_len=4096, cuda_graphs=True, compile_decode=True)
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "attention": args.attention,
                "last_layer": "every token" if args.whole_last_layer else "last tokens",
                "compile_s": round(batch.compile_now(), 1),
            }
        )
    )
    vocab = model.config.vocab_size

    def fresh(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    histories: list[list[int]] = []

    def new_histories() -> None:
        """Prefill and park fresh histories (not timed), so that every case starts from the same lengths."""
        histories[:] = [fresh(rng.randint(args.history // 2, args.history)) for _ in range(max(args.rows))]
        batch.admit(histories, [1] * len(histories), reserve=4000)
        batch.keep([], finished=dict(enumerate(histories)))

    cases = [("next turn", rows, args.new) for rows in args.rows]
    cases += [("first turn", rows, args.first) for rows in args.rows if args.first]

    def admissions(kind: str, rows: int, new: int, times: int) -> tuple[int, int, float]:
        """Admit `times` rounds of the case; the forwards, tokens and device seconds they took."""
        totals = (0, 0, 0.0)
        for _ in range(times):
            if kind == "next turn":
                prompts = [h + fresh(new) for h in histories[:rows]]
            else:
                prompts = [fresh(new) for _ in range(rows)]
            got = measured(batch, lambda p=prompts: batch.admit(p, [1] * len(p), reserve=4000))
            totals = tuple(a + b for a, b in zip(totals, got, strict=True))
            batch.keep([], finished=dict(enumerate(prompts)) if kind == "next turn" else {})
            if kind == "next turn":
                histories[:rows] = prompts
        return totals

    for kind, rows, new in cases:
        if kind == "next turn":
            new_histories()
        admissions(kind, rows, new, 1)  # the first admission of a shape captures its graph
        forwards, tokens, seconds = admissions(kind, rows, new, args.repeats)
        result = {
            "case": kind,
            "rows": rows,
            "tokens_per_forward": round(tokens / forwards),
            "forwards": forwards,
            "ms_per_forward": round(1000 * seconds / forwards, 3),
            "tokens_per_s": round(tokens / seconds),
        }
        if args.profile:  # more rounds under the profiler, so that it does not touch the timed ones
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
                profiled = admissions(kind, rows, new, args.repeats)
            result["admission_us_in_kernels"], result["kernels"] = kernel_table(
                profiler, profiled[0], args.profile
            )
        print(json.dumps(result))


if __name__ == "__main__":
    main()
