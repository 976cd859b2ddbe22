"""What a long prompt's prefill does to the rows decoding beside it, with chunked prefill on and off.

`--rows` sequences decode (greedy, `ignore_eos`) in the embedded engine; once each has its first token, one prompt
of `--prompt-len` tokens arrives. Without chunked prefill its whole prefill runs in one engine step and every
decoding row waits for it; with it (`enable_chunked_prefill`, the default) the engine computes `--budget` tokens
(`max_num_batched_tokens`) a step with a decode step of the rows between each. Per config, in one process, one
engine each: the longest gap between two tokens of a decoding row while the prompt was in the engine, the
rows' median gap, the long prompt's time to first token, and the rows' tokens/s over the whole run.

    python benchmarks/chunked_prefill.py --model tiny:qwen2 --device cpu --prompt-len 900 --budget 128
    python benchmarks/chunked_prefill.py --model tiny:qwen2.5-0.5b-shape --dtype bfloat16 --device cuda \\
        --prompt-len 16000 --budget 2048 --rows 64
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from agentrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.types import SamplingParams


async def _measure(
    engine: EmbeddedEngine, rows: int, prompt_len: int, decode_tokens: int, vocab: int
) -> dict:
    """Token arrival times of the decoding rows, and when the long prompt arrived and got its first token."""
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    times: list[list[float]] = [[] for _ in range(rows)]
    started = [asyncio.Event() for _ in range(rows)]

    async def decode(row: int) -> None:
        prompt = [(11 * row + 5 * i) % (vocab - 10) + 5 for i in range(32)]
        async for event in engine.stream(prompt, params):
            started[row].set()
            times[row] += [time.perf_counter()] * len(event.token_ids)

    begin = time.perf_counter()
    tasks = [asyncio.create_task(decode(row)) for row in range(rows)]
    for event in started:
        await event.wait()
    long = [(13 * i + 7) % (vocab - 10) + 5 for i in range(prompt_len)]
    sent = time.perf_counter()
    async for _ in engine.stream(long, SamplingParams(temperature=0.0, max_tokens=1)):
        first = time.perf_counter()
        break
    await asyncio.gather(*tasks)
    end = time.perf_counter()
    during = [b - a for row in times for a, b in zip(row, row[1:], strict=False) if b > sent and a < first]
    gaps = [b - a for row in times for a, b in zip(row, row[1:], strict=False)]
    return {
        "longest_gap_ms": 1000 * max(during, default=0.0),
        "median_gap_ms": 1000 * statistics.median(gaps),
        "ttft_ms": 1000 * (first - sent),
        "tokens_per_s": sum(len(row) for row in times) / (end - begin),
        "parts": engine.stats()["prefill_parts"],
        "rows_done_before_first_token": sum(1 for row in times if row[-1] < first),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny:qwen2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=900)
    p.add_argument("--budget", type=int, default=128, help="max_num_batched_tokens")
    p.add_argument("--decode-tokens", type=int, default=100, help="tokens each decoding row generates")
    args = p.parse_args()
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, dtype=args.dtype, device=args.device).eval()
    vocab = model.config.vocab_size
    results = {}
    for name, chunked in (("chunked", True), ("whole", False)):
        engine = EmbeddedEngine(
            model,
            tokenizer,
            max_num_seqs=args.rows + 1,
            max_model_len=args.prompt_len + 64,
            prefill_chunk_tokens=args.budget,
            chunked_prefill=chunked,
            owns_weights=False,
        )
        try:
            asyncio.run(_measure(engine, args.rows, 64, 4, vocab))  # warm-up: shapes, allocator, graphs
            results[name] = asyncio.run(
                _measure(engine, args.rows, args.prompt_len, args.decode_tokens, vocab)
            )
        finally:
            engine.close()
    print(
        f"{args.model} {args.dtype} on {args.device}: {args.rows} rows decoding, one prompt of {args.prompt_len} "
        f"tokens, budget {args.budget}"
    )
    keys = list(results["chunked"])
    print("| prefill | " + " | ".join(keys) + " |\n| --- |" + " ---: |" * len(keys))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[k]:.1f}" for k in keys) + " |")
    whole, chunked = results["whole"], results["chunked"]
    print(
        f"chunked / whole: longest gap {chunked['longest_gap_ms'] / whole['longest_gap_ms']:.2f}, "
        f"time to first token {chunked['ttft_ms'] / whole['ttft_ms']:.2f}, "
        f"tokens/s {chunked['tokens_per_s'] / whole['tokens_per_s']:.2f}"
    )


if __name__ == "__main__":
    main()
