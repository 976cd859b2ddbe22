"""Decode speed of the embedded engine: ms per decode step at 1..256 sequences, and end-to-end tokens/s.

Part 1 (decode step): the three ways the engine can hold its running batch, side by side, on the same model,
prompts and tokens:
  slot+graphs   the slot cache with one CUDA graph per batch bucket (the default on CUDA)
  slot-eager    the same slot cache and decode step, run eagerly (`enforce_eager`)
  dynamic       transformers' forward over a DynamicCache (the path before; still used for other architectures)
For each batch size it prefills `--prompt-len` tokens per row and times `--steps` decode steps (model only, no
sampling). The roofline is the time to read the weights and the KV cache once at `--bandwidth` bytes/s.

Part 2 (engine): `--sequences` completions of `--max-tokens` tokens (16 prompts x n, ignore_eos; with `--tail K`
all but the last K stop at `--short-tokens`, the shape of a GRPO step whose slowest answers run alone) through
`EmbeddedEngine.generate`, sampled at temperature 1: generated tokens / wall time, with and without graphs, and
(compiled) with the tokens drawn on the device one step ahead (the default) against the host's schedule, where
each step's tokens reach the host before the next step starts. `--engine-only` skips part 1.

    python benchmarks/decode_speed.py --model tiny:qwen2.5-0.5b-shape --dtype bfloat16 --device cuda
    python benchmarks/decode_speed.py --model tiny:qwen2 --device cpu --batches 1 8 32 --steps 16   # CPU smoke
    python benchmarks/decode_speed.py --engine-only --sequences 256 --tail 1 --skip-compile      # a step's tail
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from agentrl.models import load_causal_lm, load_tokenizer
from agentrl.rollout.engines._batch import DynamicBatch
from agentrl.rollout.engines._slot_batch import SlotBatch
from agentrl.rollout.engines._slot_decode import KVShape
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.types import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_decode(batch, prompts: list[list[int]], steps: int, device: torch.device) -> float:
    """Median ms of one decode step of `batch` holding `prompts` (after two warm-up steps)."""
    batch.admit(prompts, [1] * len(prompts), reserve=len(prompts[0]) + steps + 3)
    tokens = [7] * len(prompts)
    for _ in range(2):
        batch.decode(tokens)
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        batch.decode(tokens)
        _sync(device)
        times.append(time.perf_counter() - start)
    batch.clear()
    return 1000 * statistics.median(times)


def roofline_ms(model: torch.nn.Module, rows: int, length: int, bandwidth: float) -> float:
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return 1000 * (weights + rows * length * KVShape.of(model).bytes_per_token()) / bandwidth


def engine_throughput(
    model, tokenizer, args, cuda_graphs: bool, compile_decode: bool = False, host_schedule: bool = False
) -> dict[str, float]:
    n = args.sequences // 16
    engine = EmbeddedEngine(
        model, tokenizer, max_num_seqs=args.sequences, max_model_len=args.prompt_len + args.max_tokens + 8,
        cuda_graphs=cuda_graphs, compile_decode=compile_decode, draw_on_device=not host_schedule,
    )  # fmt: skip
    prompts = [[(13 * p + 7 * i) % 1000 + 10 for i in range(args.prompt_len)] for p in range(16)]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=n, ignore_eos=True, seed=1)
    calls = [(p, params) for p in prompts]
    if args.tail:  # one request per sequence; the last `tail` run long, the rest stop at `short_tokens`
        short = SamplingParams(temperature=1.0, max_tokens=args.short_tokens, ignore_eos=True, seed=1)
        long = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
        count = 16 * n
        calls = [(prompts[i % 16], short if i < count - args.tail else long) for i in range(count)]

    async def run() -> int:
        outs = await asyncio.gather(*[engine.generate(p, q) for p, q in calls])
        return sum(len(o.token_ids) for group in outs for o in group)

    try:
        asyncio.run(run())  # warm-up: cache allocation and graph capture
        start = time.perf_counter()
        tokens = asyncio.run(run())
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny:qwen2.5-0.5b-shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--sequences", type=int, default=128, help="engine part: 16 prompts x sequences/16")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM HBM3)")
    parser.add_argument("--skip-dynamic", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--engine-only", action="store_true", help="skip part 1 (decode step times)")
    parser.add_argument(
        "--tail", type=int, default=0,
        help="engine part: one request per sequence, the last TAIL of them --max-tokens long, the rest "
        "--short-tokens (a GRPO step's slowest answers, in the highest slots)",
    )  # fmt: skip
    parser.add_argument("--short-tokens", type=int, default=16)
    args = parser.parse_args()
    device = torch.device(args.device)
    model = load_causal_lm(args.model, dtype=args.dtype, device=args.device).eval()
    tokenizer = load_tokenizer(args.model)
    length = args.prompt_len + args.steps + 3
    paths = {
        "slot+graphs": lambda: SlotBatch(
            model, max_slots=max(args.batches), max_model_len=4096, cuda_graphs=True
        ),
        "slot+compile": lambda: SlotBatch(
            model, max_slots=max(args.batches), max_model_len=4096, cuda_graphs=True, compile_decode=True
        ),
        "slot-eager": lambda: SlotBatch(
            model, max_slots=max(args.batches), max_model_len=4096, cuda_graphs=False
        ),
    }
    if device.type != "cuda":
        paths.pop("slot+graphs")
        paths.pop("slot+compile")
    if args.skip_compile:
        paths.pop("slot+compile", None)
    if not args.skip_dynamic:
        paths["dynamic"] = lambda: DynamicBatch(model)
    print(f"model {args.model} {args.dtype} on {device}; prompt {args.prompt_len} tokens; ms per decode step")
    print(
        f"{'batch':>6} "
        + " ".join(f"{name:>12}" for name in paths)
        + f" {'roofline':>9} {'graphs/dynamic':>15}"
    )
    results = []
    for rows in [] if args.engine_only else args.batches:
        prompts = [[(31 * r + i) % 1000 + 10 for i in range(args.prompt_len)] for r in range(rows)]
        row = {name: time_decode(build(), prompts, args.steps, device) for name, build in paths.items()}
        row["roofline"] = roofline_ms(model, rows, length, args.bandwidth)
        best = row.get("slot+graphs", row["slot-eager"])
        ratio = f"{row['dynamic'] / best:.1f}x" if "dynamic" in row else "-"
        print(
            f"{rows:>6} "
            + " ".join(f"{row[n]:>12.2f}" for n in paths)
            + f" {row['roofline']:>9.2f} {ratio:>15}"
        )
        results.append({"batch": rows, **{k: round(v, 3) for k, v in row.items()}})
    engine = {"graphs": engine_throughput(model, tokenizer, args, cuda_graphs=True)}
    engine["graphs, host schedule"] = engine_throughput(model, tokenizer, args, True, host_schedule=True)
    if device.type == "cuda":
        engine["eager"] = engine_throughput(model, tokenizer, args, cuda_graphs=False)
        if not args.skip_compile:
            engine["graphs+compile"] = engine_throughput(model, tokenizer, args, True, compile_decode=True)
            engine["graphs+compile, host schedule"] = engine_throughput(
                model, tokenizer, args, True, compile_decode=True, host_schedule=True
            )
    print(f"engine, {args.sequences} x {args.max_tokens} tokens sampled: {json.dumps(engine)}")
    print(json.dumps({"decode_ms": results, "engine": engine}))


if __name__ == "__main__":
    main()
