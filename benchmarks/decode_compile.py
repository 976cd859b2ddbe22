"""What compiling the engine's decode step costs at start and buys per step: the whole step, one layer with every
size symbolic, and the engine's one layer symbolic only in the rows and the cache length.

The engine compiles its decode step (`actor_rollout_ref.rollout.compile_decode`) before the first rollout. Traced
as one graph (`step`), a 24-layer model took ~45-60 s on every start, even with Inductor's cache holding every
kernel. One decoder layer traced and run for every layer with every size symbolic (`all-dynamic`) took 13-19 s,
most of it Dynamo's symbolic reasoning, which no cache keeps. The engine's way (`layer`, `compiled_decode_step`)
keeps widths, heads and head size static. This runs each way in a fresh process, twice over the same cache
folder (cold: empty; warm: the folder the first process filled, as a second run of the same command finds it),
and prints the seconds to compile, the seconds the first decodes spend capturing CUDA graphs for three batch
buckets, and the ms of one decode step (graph replay) per bucket; the plain step (nothing compiled) for scale.

    python benchmarks/decode_compile.py --model tiny:qwen2.5-0.5b-shape --dtype bfloat16 --modes plain all-dynamic layer

On CPU (`--device cpu`: no CUDA graphs, Inductor's C++ backend; "graph capture" is then the first decodes) it
shows what the trace costs:

    python benchmarks/decode_compile.py --device cpu --model tiny:qwen2 --dtype float32 --modes all-dynamic layer \
        --buckets 8 16 --prompt-len 64 --steps 5

Compiled decoding runs under CUDA graphs in the engine, so only CUDA figures say what a run gains.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

MODES = ("plain", "step", "all-dynamic", "layer")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _one_process(args: argparse.Namespace) -> dict:
    """Build the engine's slot batch with `args.mode`'s decode step; time compile, capture and replay."""
    from agentrl.models import load_causal_lm
    from agentrl.models.compile_cache import use_compile_cache
    from agentrl.rollout.engines._compiled_steps import compiled_decode_step
    from agentrl.rollout.engines._slot_batch import SlotBatch
    from agentrl.rollout.engines._slot_decode import DecodeRegions, decode_inputs, decode_step, slot_layer

    model = load_causal_lm(args.model, dtype=args.dtype, device=args.device).eval()
    batch = SlotBatch(
        model,
        max_slots=max(args.buckets),
        max_model_len=args.prompt_len + 512,
        cuda_graphs=args.device == "cuda",
    )
    if args.mode != "plain":
        use_compile_cache(model.config, next(model.parameters()).dtype, batch.device)
        if args.mode == "step":  # the engine's first way: the whole step as one graph
            batch._decode_step = torch.compile(decode_step.__wrapped__, dynamic=True)
        elif args.mode == "all-dynamic":  # the engine's second way: one layer, every size symbolic
            regions = DecodeRegions(
                torch.compile(decode_inputs, dynamic=True), torch.compile(slot_layer, dynamic=True)
            )
            batch._decode_step = functools.partial(decode_step, regions=regions)
        else:
            batch._decode_step = compiled_decode_step()
    compile_s = batch.compile_now()
    vocab = model.config.vocab_size
    result = {"mode": args.mode, "compile_s": round(compile_s, 2), "capture_s": 0.0, "step_ms": {}}
    for rows in args.buckets:
        batch.clear()
        prompts = [[(7 * r + 3 * i) % (vocab - 10) + 5 for i in range(args.prompt_len)] for r in range(rows)]
        batch.admit(prompts, [1] * rows, reserve=args.prompt_len + 256)
        start = time.perf_counter()
        with torch.inference_mode():
            batch.decode([5] * rows)  # captures this bucket's graph
            _sync(batch.device)
            result["capture_s"] += time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(args.steps):
                batch.decode([5] * rows)
            _sync(batch.device)
        result["step_ms"][rows] = round(1000 * (time.perf_counter() - start) / args.steps, 3)
    result["capture_s"] = round(result["capture_s"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny:qwen2.5-0.5b-shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--buckets", type=int, nargs="+", default=[8, 64, 128])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one child process
    args = parser.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(_one_process(args)), flush=True)
        return
    rows = []
    for mode in args.modes:
        cache = tempfile.mkdtemp(prefix=f"decode-compile-{mode}-")
        for start in ("cold", "warm") if mode != "plain" else ("-",):
            command = [
                sys.executable,
                __file__,
                "--mode",
                mode,
                "--model",
                args.model,
                "--dtype",
                args.dtype,
                "--device",
                args.device,
                "--prompt-len",
                str(args.prompt_len),
                "--steps",
                str(args.steps),
                "--buckets",
                *map(str, args.buckets),
            ]
            env = {**os.environ, "AGENTRL_CACHE": cache}
            env.pop("TORCHINDUCTOR_CACHE_DIR", None)
            began = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                print(f"{mode} {start}: failed\n{done.stderr[-3000:]}", flush=True)
                continue
            result = json.loads(lines[-1][len("RESULT ") :])
            result.update(start=start, process_s=round(time.perf_counter() - began, 1))
            rows.append(result)
            print(json.dumps(result), flush=True)
    buckets = args.buckets
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\n{args.model} {args.dtype}, prompts of {args.prompt_len} tokens, {where}")
    print(
        "| decode step | cache | compile s | graph capture s | process s | "
        + " | ".join(f"ms/step at {b} rows" for b in buckets)
        + " |"
    )
    print("| --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in buckets) + " |")
    for r in rows:
        steps = " | ".join(str(r["step_ms"][str(b)]) for b in buckets)
        print(
            f"| {r['mode']} | {r['start']} | {r['compile_s']} | {r['capture_s']} | {r['process_s']} | {steps} |"
        )


if __name__ == "__main__":
    main()
