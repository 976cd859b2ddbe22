"""The client's cost per request of httpx's one connection pool against `ShardedHTTPTransport`, at the concurrency of
a training step's episodes.

A server in another process (uvicorn, a bare ASGI app) answers every POST with a ~1 KB JSON body after `--latency`
seconds, as a model server would, so `--concurrency` calls are in flight at once. The client posts a ~4 KB JSON body
(an agent's history) `--requests` times through each transport; it reports the wall-clock, the client process's CPU
time per request, and the ratio. Rows alternate the two transports; medians of `--repeats`.

    python benchmarks/http_pool.py --concurrency 32 128 --requests 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import httpx

from agentrl.rollout.http_transport import ShardedHTTPTransport

SERVER = """
import asyncio, json, sys, uvicorn
LATENCY = float(sys.argv[2])
BODY = json.dumps({"choices": [{"index": 0, "text": "x" * 900, "token_ids": list(range(40))}]}).encode()
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["method"] == "POST":
        await asyncio.sleep(LATENCY)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": BODY})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""

REQUEST = {"messages": [{"role": "user", "content": "word " * 800}], "max_tokens": 64}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(latency: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(latency)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the benchmark's server did not start in 30 s")


def make_transport(kind: str, concurrency: int) -> httpx.AsyncBaseTransport:
    if kind == "one pool":
        limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
        return httpx.AsyncHTTPTransport(limits=limits)
    return ShardedHTTPTransport(max_connections=concurrency * 2, max_keepalive_connections=concurrency)


async def run_once(url: str, kind: str, concurrency: int, requests: int) -> tuple[float, float]:
    """Wall seconds and client CPU seconds for `requests` POSTs, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(transport=make_transport(kind, concurrency), timeout=60) as client:

        async def one() -> None:
            async with gate:
                response = await client.post(url + "/v1/completions", json=REQUEST)
                response.raise_for_status()
                json.loads(response.content)

        await asyncio.gather(*(one() for _ in range(concurrency)))  # open the connections first
        wall, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one() for _ in range(requests)))
        return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--latency", type=float, default=0.02, help="the server's seconds per answer")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    proc, url = start_server(args.latency)
    kinds = ["one pool", "sharded"]
    try:
        print(
            f"{args.requests} POSTs, server latency {args.latency * 1000:.0f} ms, medians of {args.repeats}"
        )
        print("| concurrency | transport | wall s | requests/s | client CPU ms/request | CPU vs one pool |")
        print("| ---: | --- | ---: | ---: | ---: | ---: |")
        for concurrency in args.concurrency:
            runs: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
            for _ in range(args.repeats):
                for kind in kinds:
                    runs[kind].append(asyncio.run(run_once(url, kind, concurrency, args.requests)))
            base_cpu = statistics.median(cpu for _, cpu in runs["one pool"])
            for kind in kinds:
                wall = statistics.median(w for w, _ in runs[kind])
                cpu = statistics.median(c for _, c in runs[kind])
                print(
                    f"| {concurrency} | {kind} | {wall:.2f} | {args.requests / wall:.0f} | "
                    f"{cpu / args.requests * 1000:.3f} | {cpu / base_cpu:.2f}x |"
                )
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
