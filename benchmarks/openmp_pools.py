"""Why the embedded engine computes (and compiles) on its own thread only: OpenMP's pools of worker threads.

libgomp keeps a pool of workers for every thread that ran a parallel region. Once the pools' threads outnumber
the cores, it lets a worker spin only briefly before sleeping between regions, so every parallel region then
waits for sleeping workers to wake. The embedded engine's steps are many small torch calls on its own thread: a
model loaded, or a step compiled, with parallel work on another thread leaves a second pool behind.

Each case runs in a fresh process (a pool lives as long as its thread): `--calls` rounds of a small matrix
multiply, softmax and sum (a decode step's kind of call) on a new thread, after the main thread

- `none`: ran no parallel work (one pool, the new thread's);
- `parallel`: ran large matrix multiplies on `--threads` threads (its own pool stays);
- `one-thread`: ran them on one torch thread (no pool), the new thread taking `--threads` itself: what
  `agentrl serve` does (`EmbeddedEngine(threads=...)`).

    python benchmarks/openmp_pools.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

CASES = ("none", "parallel", "one-thread")


def run_case(case: str, threads: int, calls: int) -> float:
    """Milliseconds of the new thread's calls, in this process."""
    import torch

    torch.set_num_threads(1 if case == "one-thread" else threads)
    small, weight = torch.randn(64, 128), torch.randn(128, 768)
    if case != "none":
        for _ in range(50):
            torch.mm(torch.randn(2048, 128), weight)
    elapsed: list[float] = []

    def work() -> None:
        if case == "one-thread":
            torch.set_num_threads(threads)
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(small, weight).softmax(-1).sum()
        elapsed.append((time.perf_counter() - start) * 1000)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return elapsed[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--runs", type=int, default=3, help="processes per case, the cases taking turns")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in a child process
    args = p.parse_args()
    if args.case:
        print(run_case(args.case, args.threads, args.calls))
        return
    times: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(args.runs):
        for case in CASES:
            command = [sys.executable, __file__, "--case", case, "--threads", str(args.threads)]
            out = subprocess.run(
                [*command, "--calls", str(args.calls)], capture_output=True, text=True, check=True
            )
            times[case].append(float(out.stdout.split()[-1]))
    print(
        f"{args.calls} small calls on a new thread, {args.threads} torch threads; ms, medians of {args.runs}"
    )
    print("| the main thread before | ms | runs | vs none |\n| --- | ---: | --- | ---: |")
    base = statistics.median(times["none"])
    for case, runs in times.items():
        median = statistics.median(runs)
        print(f"| {case} | {median:.1f} | {', '.join(f'{t:.0f}' for t in runs)} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
