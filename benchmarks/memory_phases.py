"""Peak GPU memory per policy-worker call, and in the gaps between calls (generation), for a run on one GPU.

`record_worker_phases()` wraps every public method of `PolicyWorker` (local backend: the workers live in the
benchmark's process): at each call's start it prints the peak reached since the previous call ended (the gap:
rollouts, weight pushes from the controller), then resets the peak, and at its end prints the call's own peak
and what it left allocated. Lines start with `MEMORY ` so `grpo_step.py --memory-phases` can collect them:

    MEMORY gap->update_actor peak 5.10 GiB | update_actor peak 14.20 GiB, 3.10 -> 3.20 GiB allocated

`AGENTRL_MEMORY_SNAPSHOT=/path/snapshot.pickle` also records allocation history (PyTorch's memory snapshot,
open it at https://pytorch.org/memory_viz) and writes it when the call named by `AGENTRL_MEMORY_SNAPSHOT_AT`
(default `update_actor`) first ends. The peaks reset by this module are the ones the run's
`perf/max_memory_allocated_gb` reads, so that metric shows the last call's peak in such a run.
"""

from __future__ import annotations

import functools
import os

import torch

GIB = 2**30


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


def record_worker_phases() -> None:
    """Wrap `PolicyWorker`'s public methods to print their peak memory (CUDA only; a no-op elsewhere)."""
    if not torch.cuda.is_available():
        return
    from agentrl.training.workers.policy_worker import PolicyWorker

    snapshot = os.environ.get("AGENTRL_MEMORY_SNAPSHOT")
    snapshot_at = os.environ.get("AGENTRL_MEMORY_SNAPSHOT_AT", "update_actor")
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    names = [n for n, v in vars(PolicyWorker).items() if callable(v) and not n.startswith("_")]
    for name in names:
        setattr(PolicyWorker, name, _measured(getattr(PolicyWorker, name), name, snapshot, snapshot_at))


def _measured(method, name: str, snapshot: str | None, snapshot_at: str):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        torch.cuda.synchronize()
        gap_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        try:
            return method(self, *args, **kwargs)
        finally:
            torch.cuda.synchronize()
            print(
                f"MEMORY gap->{name} peak {_gib(gap_peak)} | {name} peak {_gib(torch.cuda.max_memory_allocated())}, "
                f"{_gib(before)} -> {_gib(torch.cuda.memory_allocated())} allocated",
                flush=True,
            )
            torch.cuda.reset_peak_memory_stats()
            if snapshot and name == snapshot_at and not os.path.exists(snapshot):
                torch.cuda.memory._dump_snapshot(snapshot)
                print(f"MEMORY snapshot written to {snapshot}", flush=True)

    return call


def peak_allocations(snapshot_path: str, top: int = 15) -> list[tuple[int, str]]:
    """Replay a snapshot's allocation trace: at the highest total of live blocks, the largest groups of live
    blocks by where they were allocated (the innermost frame in agentrl, peft or transformers)."""
    import pickle
    from collections import Counter

    with open(snapshot_path, "rb") as handle:
        data = pickle.load(handle)
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    at_best: dict[int, tuple[int, str]] = {}
    for trace in data.get("device_traces", []):
        for event in trace:
            action, addr, size = event.get("action"), event.get("addr"), event.get("size", 0)
            if action == "alloc":
                live[addr] = (size, _where(event.get("frames", [])))
                total += size
                if total > best:
                    best, at_best = total, dict(live)
            elif action in ("free_requested", "free_completed") and addr in live:
                total -= live.pop(addr)[0]
    groups: Counter[str] = Counter()
    for size, where in at_best.values():
        groups[where] += size
    print(f"peak of the recorded trace: {_gib(best)} live")
    return [(size, where) for where, size in groups.most_common(top)]


def _where(frames: list[dict]) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in ("agentrl/", "peft/", "transformers/")):
            return f"{name.split('site-packages/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


if __name__ == "__main__":
    import sys

    for size, where in peak_allocations(sys.argv[1]):
        print(f"{_gib(size):>12}  {where}")
