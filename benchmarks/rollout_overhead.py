"""Where a model call's time goes on the rollout path: flow, OpenAI client, gateway, server hop, scheduler.

N concurrent single-turn chat calls, every answer exactly `--tokens` tokens long (`ignore_eos` +
`min_tokens`), measured layer by layer from the inside out, each row adding one layer:

  hf-generate        `model.generate` on the N prompts as one left-padded batch (no scheduler)
  engine             `EmbeddedEngine.generate` x N, concurrently (the scheduler and sampling)
  server-asgi        + the OpenAI server's work (validation, chat template, response JSON), in-process
  server-http        + the TCP hop and uvicorn thread: the official async openai client -> server
  gateway-http       + the gateway: openai client -> gateway (TCP) -> pool -> server (TCP)
  gateway-inproc     the same, but the pool calls the in-process server (no 2nd TCP hop)
  gateway-asgi-hop   the client reaches the gateway through ASGI too, and the pool the server through ASGI
  gateway-asgi       the same, with the pool calling the server's handler as Python (`server.DirectCalls`)
  collector-http     + the collector and an AgentFlow (sessions, traces, episodes), every hop over TCP
  collector-inproc   the same with the pool calling the engine's server in-process
  collector-asgi-hop the same with the collector calling the gateway in-process too (pool -> server over ASGI)
  collector-asgi     ... and the pool calling the server's handler directly: what training runs
  collector-group-calls  the same N rollouts as N/--group tasks x n=--group, one call per rollout
  collector-grouped  the same tasks, each task's group in one call with n choices (`agent.group_calls`)

Rows are measured round-robin `--repeats` times; the median wall time is reported, with ms per call
and completion tokens/s. The split below the table is the difference between adjacent rows.

    .venv/bin/python benchmarks/rollout_overhead.py [--model tiny:qwen2] [--calls 64] [--tokens 16]
    python benchmarks/rollout_overhead.py --model tiny:qwen2.5-0.5b-shape --device cuda --dtype bfloat16 \
        --calls 128 --tokens 256 --rows hf-generate engine server-asgi gateway-asgi collector-asgi   # GPU
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
import openai
import torch

from agentrl.flow import SingleTurnChatFlow
from agentrl.models import load_causal_lm, load_tokenizer
from agentrl.rollout.app import build_server_app
from agentrl.rollout.chat import render_chat
from agentrl.rollout.collector import CollectorLimits, RolloutCollector
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.rollout.gateway import Gateway
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.uvicorn_thread import start_server_in_thread
from agentrl.types import SamplingParams, Task

MODEL_NAME = "bench"


def build_messages(count: int) -> list[list[dict[str, str]]]:
    names = ["Alice", "Bob", "Carla", "Dmitri", "Emma", "Farid", "Grace", "Hiro"]
    return [
        [
            {
                "role": "user",
                "content": f"{names[i % 8]} has {i + 3} apples and buys {2 * i + 1} more. How many?",
            }
        ]
        for i in range(count)
    ]


def fixed_length(tokens: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, min_tokens=tokens, seed=seed)


def run_hf_generate(model, tokenizer, prompts: list[list[int]], tokens: int) -> int:
    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=True, max_new_tokens=tokens,
                             min_new_tokens=tokens, pad_token_id=pad)  # fmt: skip
    return int(out[:, width:].numel())


async def run_engine(engine: EmbeddedEngine, prompts: list[list[int]], tokens: int) -> int:
    outs = await asyncio.gather(*(engine.generate(p, fixed_length(tokens, i)) for i, p in enumerate(prompts)))
    return sum(len(o[0].token_ids) for o in outs)


def _chat_body(messages, tokens: int) -> dict:
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": tokens, "min_tokens": tokens,
            "ignore_eos": True, "temperature": 1.0}  # fmt: skip


async def run_server_asgi(app, conversations, tokens: int) -> int:
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://server", timeout=600) as http:
        replies = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=_chat_body(m, tokens)) for m in conversations)
        )
    return sum(r.json()["usage"]["completion_tokens"] for r in replies)


async def run_openai(base_url: str, conversations, tokens: int, app=None) -> int:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=128)
    transport = httpx.ASGITransport(app) if app is not None else None
    async with httpx.AsyncClient(timeout=600, limits=limits, transport=transport) as http:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, http_client=http)
        replies = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=m,
                    max_tokens=tokens,
                    temperature=1.0,
                    extra_body={"min_tokens": tokens, "ignore_eos": True},
                )  # fmt: skip
                for m in conversations
            )
        )
    return sum(r.usage.completion_tokens for r in replies)


async def run_collector(
    gateway: Gateway,
    conversations,
    calls: int,
    in_process: bool = False,
    group: int = 1,
    grouped: bool = False,
) -> int:
    """`calls` rollouts of SingleTurnChatFlow: `calls / group` tasks x n=`group`, in one call per task when
    `grouped` (`agent.group_calls`), else one call per rollout."""
    limits = CollectorLimits(max_steps=2, n_parallel_tasks=calls, group_calls=grouped, max_n=group)
    collector = RolloutCollector(gateway, MODEL_NAME, limits, in_process=in_process)
    tasks = [Task(id=f"t{i}", data={"prompt": m}) for i, m in enumerate(conversations[: calls // group])]
    episodes = await collector.collect(SingleTurnChatFlow(), tasks, n=group)
    errors = [e.error for e in episodes if e.error]
    if errors:
        raise RuntimeError(f"{len(errors)} rollouts failed; first: {errors[0]}")
    return sum(len(s.response_ids) for e in episodes for t in e.trajectories for s in t.steps)


def build_gateway(
    server_url: str, tokens: int, *, in_process: bool, direct: bool = True, max_n: int = 1
) -> Gateway:
    pool = RolloutPool([server_url], model_name=MODEL_NAME, in_process=in_process, direct=direct)
    # The mode fixes the length too, so the collector's plain flow gets `tokens`-long answers.
    return Gateway(pool, sampling_train=fixed_length(tokens), max_n=max_n).start()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny:qwen2")
    parser.add_argument("--calls", type=int, default=64, help="concurrent single-turn chat calls (N)")
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per call (fixed)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", nargs="+", help="measure only these rows (names as in the table)")
    parser.add_argument("--group", type=int, default=8, help="rollouts per task of the collector-group* rows")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model, dtype=args.dtype, device=args.device)
    conversations = build_messages(args.calls)
    prompts = [render_chat(tokenizer, m) for m in conversations]
    engine = EmbeddedEngine(
        model,
        tokenizer,
        max_num_seqs=max(64, args.calls),
        max_model_len=512,
        compile_decode=args.device == "cuda",  # what training runs on a GPU (rollout.compile_decode)
    )
    app = build_server_app(engine, tokenizer, model_name=MODEL_NAME, max_model_len=512, max_n=args.group)
    server = start_server_in_thread(app)
    via_tcp = build_gateway(server.url, args.tokens, in_process=False)
    in_proc = build_gateway(server.url, args.tokens, in_process=True, max_n=args.group)
    asgi_hop = build_gateway(server.url, args.tokens, in_process=True, direct=False)
    n, t = args.calls, args.tokens

    rows: dict[str, Callable[[], Awaitable[int] | int]] = {
        "hf-generate": lambda: run_hf_generate(model, tokenizer, prompts, t),
        "engine": lambda: run_engine(engine, prompts, t),
        "server-asgi": lambda: run_server_asgi(app, conversations, t),
        "server-http": lambda: run_openai(server.url + "/v1", conversations, t),
        "gateway-http": lambda: run_openai(via_tcp.open_session(None), conversations, t),
        "gateway-inproc": lambda: run_openai(in_proc.open_session(None), conversations, t),
        "gateway-asgi-hop": lambda: run_openai(
            asgi_hop.open_session(None), conversations, t, app=asgi_hop.app
        ),
        "gateway-asgi": lambda: run_openai(in_proc.open_session(None), conversations, t, app=in_proc.app),
        "collector-http": lambda: run_collector(via_tcp, conversations, n),
        "collector-inproc": lambda: run_collector(in_proc, conversations, n),
        "collector-asgi-hop": lambda: run_collector(asgi_hop, conversations, n, in_process=True),
        "collector-asgi": lambda: run_collector(in_proc, conversations, n, in_process=True),
        "collector-group-calls": lambda: run_collector(in_proc, conversations, n, True, group=args.group),
        "collector-grouped": lambda: run_collector(
            in_proc, conversations, n, True, group=args.group, grouped=True
        ),
    }

    if args.rows:
        unknown = sorted(set(args.rows) - set(rows))
        if unknown:
            parser.error(f"unknown --rows {unknown}; choose from {list(rows)}")
        rows = {name: fn for name, fn in rows.items() if name in args.rows}

    def once(fn: Callable[[], Awaitable[int] | int]) -> tuple[float, int]:
        start = time.perf_counter()
        result = fn()
        tokens = asyncio.run(result) if asyncio.iscoroutine(result) else result
        return time.perf_counter() - start, tokens

    print(f"model {args.model}, {n} concurrent calls x {t} tokens, torch threads {torch.get_num_threads()}, "
          f"median of {args.repeats}\n")  # fmt: skip
    try:
        for fn in rows.values():  # warm-up
            once(fn)
        walls: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.repeats):
            for name, fn in rows.items():
                wall, tokens = once(fn)
                if tokens != n * t:
                    raise RuntimeError(f"{name}: {tokens} tokens, expected {n * t}")
                walls[name].append(wall)
    finally:
        via_tcp.stop()
        in_proc.stop()
        asgi_hop.stop()
        server.stop()
        engine.close()

    median = {name: statistics.median(w) for name, w in walls.items()}
    base = median.get("engine", next(iter(median.values())))
    print(f"{'path':<18}{'wall s':>9}{'ms/call':>9}{'tok/s':>9}{'x engine':>10}")
    for name, wall in median.items():
        print(f"{name:<18}{wall:>9.3f}{1000 * wall / n:>9.1f}{n * t / wall:>9.0f}{wall / base:>10.2f}")
    steps = [("scheduler vs one static batch", "hf-generate", "engine"),
             ("server work (validation, template, JSON)", "engine", "server-asgi"),
             ("client -> server TCP hop", "server-asgi", "server-http"),
             ("gateway + pool -> server TCP hop", "server-http", "gateway-http"),
             ("gateway + pool -> server in-process", "server-http", "gateway-inproc"),
             ("client -> gateway TCP hop", "gateway-asgi", "gateway-inproc"),
             ("collector + flow (pool over TCP)", "gateway-http", "collector-http"),
             ("collector + flow (pool in-process)", "gateway-inproc", "collector-inproc"),
             ("full path saved by the in-process pool", "collector-inproc", "collector-http"),
             ("collector -> gateway TCP hop", "collector-asgi", "collector-inproc"),
             ("pool -> server: ASGI hop vs direct call", "collector-asgi", "collector-asgi-hop"),
             ("a task's group in one call vs n calls", "collector-grouped", "collector-group-calls")]  # fmt: skip
    print("\nsplit (difference of median wall times, s):")
    for label, a, b in steps:
        if a not in median or b not in median:
            continue
        print(f"  {label:<42}{median[b] - median[a]:>+8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
