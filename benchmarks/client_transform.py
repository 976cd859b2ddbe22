"""What a flow's `openai` call costs on the event loop, with openai's request walk and with agentrl's fast path.

One real `openai.AsyncOpenAI` sends chat requests through `httpx.ASGITransport` to an ASGI app that answers a fixed
completion at once, so the figures are the client's own Python (request transform, request building, response
parsing) plus the ASGI hop, nothing of a model. The history is an agent's: a ~250-word system prompt, then per turn a
~40-word observation and a ~50-word answer. Rows alternate the two paths; medians of `--repeats`.

    python benchmarks/client_transform.py --turns 1 4 8 --calls 200 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
import openai

from agentrl.rollout.client_transform import fast_transform, install_fast_transform

ANSWER = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ans " * 50}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}  # fmt: skip


async def _answer(scope, receive, send):
    while (await receive()).get("more_body"):
        pass
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": json.dumps(ANSWER).encode()})


def history(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "word " * 250}]
    for _ in range(turns - 1):
        messages += [{"role": "user", "content": "obs " * 40}, {"role": "assistant", "content": "ans " * 50}]
    return messages + [{"role": "user", "content": "obs " * 40}]


async def time_calls(client: openai.AsyncOpenAI, messages: list[dict], calls: int, fast: bool) -> float:
    """Seconds per call, `calls` calls one after another."""
    started = time.perf_counter()
    for _ in range(calls):
        if fast:
            with fast_transform():
                await client.chat.completions.create(model="m", messages=messages, max_tokens=50)
        else:
            await client.chat.completions.create(model="m", messages=messages, max_tokens=50)
    return (time.perf_counter() - started) / calls


async def main(args: argparse.Namespace) -> None:
    install_fast_transform()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=_answer))
    client = openai.AsyncOpenAI(base_url="http://bench/v1", api_key="k", http_client=http, max_retries=0)
    print(f"openai {openai.__version__}, {args.calls} calls per run, median of {args.repeats}\n")
    print("| turns | messages | openai's walk ms/call | fast path ms/call | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for turns in args.turns:
        messages = history(turns)
        await time_calls(client, messages, 20, False)  # warm caches and the connection
        await time_calls(client, messages, 20, True)
        runs = {False: [], True: []}
        for _ in range(args.repeats):
            for fast in (False, True):
                runs[fast].append(await time_calls(client, messages, args.calls, fast))
        walk, fast = statistics.median(runs[False]) * 1e3, statistics.median(runs[True]) * 1e3
        print(f"| {turns} | {len(messages)} | {walk:.2f} | {fast:.2f} | {walk / fast:.2f}x |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
