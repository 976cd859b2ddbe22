"""The embedded engine's prefill forward on a GPU, by its size: how its device time and tokens/s grow with the
rows and tokens one admission computes (agents' next turns over cached histories, and first turns).

Through the engine's slot cache as the engine drives it (`SlotBatch.admit`, CUDA graphs, compiled steps):
`--rows` histories of ~`--history` tokens are prefilled and parked, then each (rows, new tokens) case admits
that many next turns of that many tokens each, `--repeats` times (each turn's history is the one before plus
its turn, parked again), and reads the forwards' device time off the engine's counters (timed from the graph
replay: captures and input copies are host work, not counted). A first-turn case (`--first`) admits fresh
prompts of that many tokens instead (no cached history).

    python benchmarks/prefill_forward.py --model tiny:qwen2.5-0.5b-shape --rows 4 8 16 32 64 --new 48 \\
        --first 256 [--attention flash] [--whole-last-layer]

Prints one JSON line per case: rows, tokens a forward, forwards, milliseconds a forward, tokens/s.
"""

from __future__ import annotations

import argparse
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

    histories = [fresh(rng.randint(args.history // 2, args.history)) for _ in range(max(args.rows))]
    batch.admit(histories, [1] * len(histories), reserve=4000)
    batch.keep([], finished=dict(enumerate(histories)))
    cases = [("next turn", rows, args.new) for rows in args.rows]
    cases += [("first turn", rows, args.first) for rows in args.rows if args.first]
    for kind, rows, new in cases:
        for warm in (True, False):  # the first admission of a shape captures its graph
            totals = [0, 0, 0.0]
            for _ in range(1 if warm else args.repeats):
                if kind == "next turn":
                    prompts = [h + fresh(new) for h in histories[:rows]]
                else:
                    prompts = [fresh(new) for _ in range(rows)]
                got = measured(batch, lambda p=prompts: batch.admit(p, [1] * len(p), reserve=4000))
                totals = [a + b for a, b in zip(totals, got, strict=True)]
                batch.keep([], finished=dict(enumerate(prompts)) if kind == "next turn" else {})
                if kind == "next turn":
                    histories[:rows] = prompts
            if warm:
                continue
            forwards, tokens, seconds = totals
            print(
                json.dumps(
                    {
                        "case": kind,
                        "rows": rows,
                        "tokens_per_forward": round(tokens / forwards),
                        "forwards": forwards,
                        "ms_per_forward": round(1000 * seconds / forwards, 3),
                        "tokens_per_s": round(tokens / seconds),
                    }
                )
            )


if __name__ == "__main__":
    main()
