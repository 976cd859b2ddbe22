"""How much a thread of many small torch calls slows down beside a thread of pure Python, per switch interval.

Why: in the asynchronous loop the update runs in the trainer's thread while the agents' event loop (flows, the
`openai` client, the gateway, the server) and the engine's thread run in the same process. Every torch call
releases the GIL while it runs and must take it back afterwards; a thread running pure Python gives the GIL up
only when the interpreter's switch interval (5 ms by default) has passed. A call that takes microseconds can so
cost a whole interval. This measures that effect in isolation: a host-bound "update" (forward and backward of
48 small linear layers, one torch thread) alone and beside a thread that encodes and decodes JSON without pause.

    OMP_NUM_THREADS=1 python benchmarks/gil_convoy.py --intervals 5 1 0.5 0.1
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--intervals", type=float, nargs="+", default=[5.0, 1.0, 0.5, 0.1], help="switch intervals, ms"
    )
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--iterations", type=int, default=60, help="forward and backward passes per measurement")
    return p


def make_update(layers: int, width: int, iterations: int):
    torch.manual_seed(0)
    linears = [torch.nn.Linear(width, width) for _ in range(layers)]
    params = [p for layer in linears for p in layer.parameters()]
    x = torch.randn(16, width)

    def update() -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            h = x
            for layer in linears:
                h = torch.nn.functional.silu(layer(h)) + h * 0.5
            h.square().mean().backward()
            for p in params:
                p.grad = None
        return time.perf_counter() - start

    return update


def busy_python(stop: threading.Event) -> None:
    """Pure Python, never waiting: what an event loop full of request bodies to build and parse looks like."""
    doc = {"messages": [{"role": "user", "content": "x" * 200, "n": i} for i in range(20)]}
    while not stop.is_set():
        json.loads(json.dumps(doc))


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    update = make_update(args.layers, args.width, args.iterations)
    update()  # warm-up
    rows = []
    default = sys.getswitchinterval()
    try:
        for interval in args.intervals:
            sys.setswitchinterval(interval / 1000)
            alone = min(update() for _ in range(2))
            stop = threading.Event()
            other = threading.Thread(target=busy_python, args=(stop,))
            other.start()
            try:
                shared = min(update() for _ in range(2))
            finally:
                stop.set()
                other.join()
            rows.append({"interval_ms": interval, "alone_s": alone, "beside_busy_s": shared})
    finally:
        sys.setswitchinterval(default)
    print("| switch interval ms | update alone s | beside a busy Python thread s | slowdown |")
    print("| ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = r["beside_busy_s"] / r["alone_s"]
        print(f"| {r['interval_ms']:g} | {r['alone_s']:.3f} | {r['beside_busy_s']:.3f} | {ratio:.1f}x |")
    return rows


if __name__ == "__main__":
    main()
