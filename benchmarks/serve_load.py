"""Load and bad input against `agentrl serve`, as a user runs it: the figures of docs/reliability.md.

Starts `agentrl serve --model tiny:qwen2` in its own process, then:
  1. `--requests` concurrent chat calls from the official async openai client (sampled, `--max-tokens` each);
     reports how many were answered, the wall time and latency percentiles;
  2. the same number again while a set of malformed requests is sent alongside; reports what each malformed
     request got back (status and the field the error names), and that every good call was still answered;
  3. Ctrl-C; reports the exit code and that no process is left.

    .venv/bin/python benchmarks/serve_load.py [--requests 1000] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import httpx
import openai

BAD_REQUESTS = {
    "body is not JSON": (b"{not json", "application/json"),
    "no messages": ({"model": "tiny:qwen2"}, None),
    "unknown model": ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, None),
    "n above the cap": ({"messages": [{"role": "user", "content": "hi"}], "n": 10_000}, None),
    "tool message without tool_call_id": (
        {"messages": [{"role": "user", "content": "2+3?"}, {"role": "tool", "content": "5"}]},
        None,
    ),
    "image to a text-only model": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                }
            ]
        },
        None,
    ),
    "temperature negative": ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, None),
    "max_tokens zero": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, None),
    "min_tokens above max_tokens": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "min_tokens": 5},
        None,
    ),
    "tool_choice names a missing tool": (
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
            "tool_choice": {"type": "function", "function": {"name": "mul"}},
        },
        None,
    ),
}


def start_serve(max_tokens: int) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "agentrl.cli",
        "serve",
        "--model",
        "tiny:qwen2",
        "--max-tokens",
        str(max_tokens),
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if m := re.search(r"behind the gateway at (http://[\d.]+:\d+)", line):
            return proc, m.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    sys.exit("agentrl serve did not start")


async def good_calls(base: str, count: int, max_tokens: int, tag: str) -> tuple[int, list[float], float]:
    """`count` concurrent calls, each in its own gateway session (as agents make them)."""
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=count), timeout=600)
    latencies: list[float] = []

    async def one(i: int) -> bool:
        client = openai.AsyncOpenAI(
            base_url=f"{base}/sessions/{tag}{i}/v1", api_key="x", max_retries=0, timeout=600, http_client=http
        )
        start = time.perf_counter()
        reply = await client.chat.completions.create(
            model="tiny:qwen2",
            messages=[{"role": "user", "content": f"What is {i} + {i}?"}],
            max_tokens=max_tokens,
        )
        latencies.append(time.perf_counter() - start)
        return bool(reply.choices)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
    wall = time.perf_counter() - start
    return sum(r is True for r in results), latencies, wall


async def bad_calls(base: str) -> dict[str, tuple[int, str | None]]:
    answers = {}
    async with httpx.AsyncClient(timeout=60) as client:
        for name, (body, content_type) in BAD_REQUESTS.items():
            url = f"{base}/sessions/bad/v1/chat/completions"
            if isinstance(body, bytes):
                resp = await client.post(url, content=body, headers={"Content-Type": content_type})
            else:
                resp = await client.post(url, json=body)
            try:
                param = resp.json()["error"].get("param")
            except (ValueError, KeyError, TypeError):
                param = None
            answers[name] = (resp.status_code, param)
    return answers


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def run(base: str, args: argparse.Namespace) -> dict:
    answered, latencies, wall = await good_calls(base, args.requests, args.max_tokens, "load")
    if not latencies:
        sys.exit("no call was answered")
    load = {
        "requests": args.requests,
        "answered": answered,
        "wall_s": round(wall, 1),
        "p50_s": round(percentile(latencies, 50), 2),
        "p99_s": round(percentile(latencies, 99), 2),
    }
    good, bad = await asyncio.gather(
        good_calls(base, args.requests, args.max_tokens, "mixed"), bad_calls(base)
    )
    return {"load": load, "bad_inputs": bad, "answered_beside_bad_inputs": good[0]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    proc, base = start_serve(args.max_tokens)
    try:
        result = asyncio.run(run(base, args))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    result["ctrl_c"] = {"exit_code": proc.returncode, "processes_left": len(left)}
    load = result["load"]
    print(
        f"{load['answered']}/{load['requests']} concurrent calls answered in {load['wall_s']} s "
        f"(p50 {load['p50_s']} s, p99 {load['p99_s']} s)"
    )
    for name, (status, param) in result["bad_inputs"].items():
        print(f"  {name:<36} -> {status} param={param}")
    print(
        f"good calls answered beside the bad inputs: {result['answered_beside_bad_inputs']}/{args.requests}"
    )
    print(f"Ctrl-C: exit {proc.returncode}, {len(left)} processes left")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
