"""Prefill speed of the embedded engine's slot path: the packed forward and the short-run graph, per shape.

An agent's follow-up turn prefills a few dozen new tokens over a long cached history; its first turn, a few
hundred. This times each path on its own (no scheduler, no HTTP), as tokens computed per second of forward:

    python benchmarks/prefill_speed.py --model tiny:qwen2.5-0.5b-shape --dtype bfloat16 --device cuda
    python benchmarks/prefill_speed.py --model tiny:qwen2 --dtype float32 --device cpu --history 128
    python benchmarks/prefill_speed.py --model tiny:qwen2.5-0.5b-shape --dtype bfloat16 --device cuda --compile
    python benchmarks/prefill_speed.py --model tiny:qwen2.5-0.5b-shape --dtype bfloat16 --device cuda \
        --history 1400 --profile-rows 8 16

`--profile-rows`: where one extend forward's device time goes (torch profiler, kernels grouped by kind) for R
rows x 64 new tokens over `--history` cached ones: the agent step's next turns.

- `extend`: R rows x W new tokens each over `--history` cached positions (`extend_step`, a CUDA graph on CUDA);
- `packed`: R prompts of `--prompt` tokens from scratch (`prefill_slots`, eager);
and, for scale, one decode step over the same rows.
"""

from __future__ import annotations

import argparse
import time

import torch

from agentrl.models import load_causal_lm
from agentrl.rollout.engines._slot_batch import SlotBatch


def _time(fn, device: str, repeat: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny:qwen2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--history", type=int, default=1024)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--profile-rows", type=int, nargs="*", default=[], help="profile an extend forward (CUDA)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step, as the engine does by default (compile_decode)",
    )
    args = p.parse_args()
    model = load_causal_lm(args.model, dtype=args.dtype, device=args.device).eval()
    batch = SlotBatch(
        model,
        max_slots=128,
        max_model_len=args.history + 512,
        cuda_graphs=args.device == "cuda",
        compile_decode=args.compile,
    )
    print(f"compiled in {batch.compile_now():.1f} s" if args.compile else "steps not compiled")
    vocab = model.config.vocab_size
    print(f"{args.model} {args.dtype} on {args.device}; history {args.history}, prompt {args.prompt}")
    print("| path | rows | tokens each | ms | tokens/s |\n| --- | ---: | ---: | ---: | ---: |")
    for rows in (1, 8, 32, 128):
        prompts = [[(7 * r + 3 * i) % (vocab - 10) + 5 for i in range(args.history)] for r in range(rows)]
        batch.clear()
        batch.admit(prompts, [1] * rows, reserve=args.history + 128)  # histories cached in slots 0..rows-1
        slots = list(batch._row_slots)
        for width in (16, 64):
            ms = _time(
                lambda w=width, s=slots: _extend_once(batch, s, w, args.history, vocab),
                args.device,
                args.repeat,
            )
            print(f"| extend | {rows} | {width} | {ms * 1000:.2f} | {rows * width / ms:,.0f} |")
        fresh = [[(11 * r + 5 * i) % (vocab - 10) + 5 for i in range(args.prompt)] for r in range(rows)]
        computed = {r: fresh[r] for r in range(rows)}
        plan = {r: (slots[r], 0) for r in range(rows)}
        ms = _time(lambda p=plan, c=computed: batch._prefill_chunks(p, c), args.device, args.repeat)
        print(f"| packed | {rows} | {args.prompt} | {ms * 1000:.2f} | {rows * args.prompt / ms:,.0f} |")
        with torch.inference_mode():
            ms = _time(lambda n=rows: batch.decode([5] * n), args.device, args.repeat)
        print(f"| decode step | {rows} | 1 | {ms * 1000:.2f} | {rows / ms:,.0f} |")
    for rows in args.profile_rows:
        _profile_extend(batch, rows, args.history, vocab, args.repeat)


KERNEL_KINDS = (
    ("attention (SDPA)", ("sdpa", "flash", "fmha", "attention")),
    ("cache rows gathered (index_select)", ("indexselect",)),
    ("cache written (index_put)", ("index_elementwise", "indexput")),
    ("matrix multiplies", ("gemm", "nvjet", "cutlass", "sm90_xmma")),
)


def _kind(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in name for m in marks)), "everything else")


def _profile_extend(batch: SlotBatch, rows: int, history: int, vocab: int, repeat: int) -> None:
    """Device time of one extend forward of `rows` x 64 tokens over `history` cached ones, by kernel kind."""
    from torch.profiler import ProfilerActivity, profile

    prompts = [[(7 * r + 3 * i) % (vocab - 10) + 5 for i in range(history)] for r in range(rows)]
    batch.clear()
    batch.admit(prompts, [1] * rows, reserve=history + 128)
    slots = list(batch._row_slots)
    ms = _time(lambda: _extend_once(batch, slots, 64, history, vocab), "cuda", repeat)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            _extend_once(batch, slots, 64, history, vocab)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kind = totals.setdefault(_kind(event.key), [0.0, 0])
            kind[0] += event.self_device_time_total / 1000 / repeat
            kind[1] += event.count / repeat
    device_ms = sum(ms_ for ms_, _ in totals.values())
    print(
        f"\nextend forward, {rows} rows x 64 over {history} cached: {ms * 1000:.2f} ms a call, {device_ms:.2f} ms of kernels"
    )
    print("| kernels | ms a forward | kernels a forward | share |\n| --- | ---: | ---: | ---: |")
    for kind, (kind_ms, count) in sorted(totals.items(), key=lambda item: -item[1][0]):
        print(f"| {kind} | {kind_ms:.2f} | {count:.0f} | {kind_ms / device_ms:.0%} |")


def _extend_once(batch: SlotBatch, slots: list[int], width: int, history: int, vocab: int) -> None:
    """One `extend_step` call: `width` new tokens after `history` cached ones in each of `slots`."""
    rows = len(slots)
    tokens = torch.randint(5, vocab - 5, (batch._bucket(rows), width))
    positions = torch.full(tokens.shape, batch.sink, dtype=torch.long)
    positions[:rows] = torch.arange(history, history + width)
    slot_ids = torch.zeros(tokens.shape[0], dtype=torch.long)
    slot_ids[:rows] = torch.tensor(slots)
    last = torch.full((tokens.shape[0],), width - 1, dtype=torch.long)
    span = max(256, 1 << (history + width - 1).bit_length())
    offsets = torch.zeros(tokens.shape[0], dtype=torch.long)
    batch._extend_call(tokens, positions, slot_ids, last, min(span, batch.length), offsets)


if __name__ == "__main__":
    main()
