"""Peak GPU memory per policy-worker call, and in the gaps between calls (generation), for a run on one GPU;
and `PeakSampler`, the peak host and device memory of a whole run (its Ray workers included).

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


class PeakSampler:
    """Samples, every `interval` seconds in a thread, the host and device memory a run uses; `peaks()` gives GiB:

    - `host_rss`: resident memory of this process and all its descendants (Ray's raylet and workers are
      descendants of the driver that started them), pinned buffers included; shared pages count once per
      process that maps them;
    - `host_used`: the machine's used memory (total - available) above what it was at `start()`: one machine,
      no double counting, but anything else running on it counts too;
    - `gpu_used`: the busiest GPU's used memory as `nvidia-smi` reports it (CUDA contexts and every process
      included), 0 without `nvidia-smi`.
    """

    def __init__(self, interval: float = 0.5) -> None:
        import threading

        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._peaks = {"host_rss": 0, "host_used": 0, "gpu_used": 0}

    def start(self) -> PeakSampler:
        import psutil

        self._baseline = psutil.virtual_memory().total - psutil.virtual_memory().available
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peaks()

    def peaks(self) -> dict[str, float]:
        return {k: round(v / GIB, 2) for k, v in self._peaks.items()}

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        import psutil

        me = psutil.Process()
        rss = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                rss += proc.memory_info().rss
            except psutil.Error:  # ended between the listing and the read
                pass
        memory = psutil.virtual_memory()
        sample = {"host_rss": rss, "host_used": memory.total - memory.available - self._baseline}
        sample["gpu_used"] = _gpu_used_bytes()
        self._peaks = {k: max(v, sample[k]) for k, v in self._peaks.items()}


def _gpu_used_bytes() -> int:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return 0
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    )
    used = [int(v) for v in done.stdout.split() if v.strip().isdigit()]
    return max(used, default=0) * 2**20  # MiB


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
