"""Where agentrl's steps of `learning_vs_trl.py` spend their time: stack samples of the slowest updates, and a
`torch.profiler` table of one step's update.

Runs agentrl's side of `benchmarks/learning_vs_trl.py` (the arguments after `--` are that script's; `--only
agentrl` is added) in this process, with a thread that samples the main thread's Python stack every
`--sample-ms` ms. After the run it writes to `--out`:
- `stalls.txt`: for the `--slowest` slowest updates (ref, update, sleep and sync: `Controller.update`) after step 2,
  and one of median length, how many samples fell in each innermost call and in each deeper stack. An update
  that stalls shows where it waited (the thirtieth session found cuDNN's attention building plans this way:
  docs/benchmarks.md, "The SmolLM2 sums: the allocator's cache kept").
- `torch_update_<step>.txt` (with `--torch-step`): the profiler's operators of that step's update, by host and
  by device time (cudaMalloc and cudaFree counts included: the allocator's cache was found so).

    python benchmarks/profile_steps.py --torch-step 13 --out outputs/profile -- --device cuda --seed 1 \\
        --steps 20 --eval-every 10 --dtype bfloat16 --master-dtype float32 --micro-batch 256
    python benchmarks/profile_steps.py --out /tmp/profile -- --device cpu --steps 4 --prompts 4 --n 4 \\
        --max-tokens 16 --eval-every 4 --eval-problems 8 --eval-max-tokens 16                # CPU smoke
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import learning_vs_trl  # noqa: E402

from agentrl.training.controller import Controller  # noqa: E402

TIMED_PHASES = ("ref", "update_actor", "sleep_rollout", "wake_rollout", "sync_weights")


class StackSampler:
    """Samples one thread's innermost Python frames every `period_s` seconds, on a daemon thread."""

    def __init__(self, thread_id: int, period_s: float, depth: int = 12) -> None:
        self.thread_id, self.period_s, self.depth = thread_id, period_s, depth
        self.samples: list[tuple[float, list[str]]] = []
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="stack-sampler").start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            frame = sys._current_frames().get(self.thread_id)
            if frame is not None:
                stack = traceback.extract_stack(frame)[-self.depth :]
                self.samples.append(
                    (time.perf_counter(), [f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in stack])
                )

    def histogram(self, start: float, end: float, frames: int) -> collections.Counter:
        """How many samples between `start` and `end` had each chain of `frames` innermost frames."""
        return collections.Counter(
            " <- ".join(reversed(stack[-frames:])) for t, stack in self.samples if start <= t <= end
        )


def profile_update(update, controller, batch, timing, out: Path, step: int):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        metrics = update(controller, batch, timing)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.key_averages()
    sort_device = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
    (out / f"torch_update_{step}.txt").write_text(
        events.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60)
        + "\n\n"
        + events.table(sort_by=sort_device, row_limit=30, max_name_column_width=60)
    )
    return metrics


def stall_report(sampler: StackSampler, updates: list[tuple[int, float, float, dict]], slowest: int) -> str:
    later = sorted((u for u in updates if u[0] > 2), key=lambda u: u[2] - u[1], reverse=True)
    picks = later[:slowest] + later[len(later) // 2 : len(later) // 2 + 1]
    lines = []
    for step, start, end, timing in picks:
        phases = {k: round(v, 3) for k, v in timing.items() if k.removeprefix("timing/") in TIMED_PHASES}
        inner = sampler.histogram(start, end, 3)
        lines.append(
            f"=== step {step}: update {end - start:.3f} s, {sum(inner.values())} samples; {json.dumps(phases)}"
        )
        lines += [f"  {count:4d}  {chain}" for chain, count in inner.most_common(12)]
        lines.append("  -- deeper:")
        lines += [
            f"  {count:4d}  {chain}" for chain, count in sampler.histogram(start, end, 8).most_common(6)
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default="outputs/profile_steps", help="folder for stalls.txt and the profiler table"
    )
    parser.add_argument("--sample-ms", type=float, default=10.0, help="stack sampling period")
    parser.add_argument("--slowest", type=int, default=3, help="how many of the slowest updates to report")
    parser.add_argument("--torch-step", type=int, default=0, help="profile this step's update (0: none)")
    parser.add_argument(
        "learning_args", nargs=argparse.REMAINDER, help="-- then learning_vs_trl.py's arguments"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    learning = [a for a in args.learning_args if a != "--"]
    sampler = StackSampler(threading.get_ident(), args.sample_ms / 1000)
    updates: list[tuple[int, float, float, dict]] = []
    update = Controller.update

    def timed_update(controller, batch, timing):
        step = controller.global_step + 1  # set after the update
        start = time.perf_counter()
        if step == args.torch_step:
            metrics = profile_update(update, controller, batch, timing, out, step)
        else:
            metrics = update(controller, batch, timing)
        updates.append((step, start, time.perf_counter(), dict(timing)))
        return metrics

    Controller.update = timed_update  # this process only
    try:
        learning_vs_trl.main([*learning, "--only", "agentrl", "--out", str(out / "run")])
    finally:
        sampler.stop()
        (out / "stalls.txt").write_text(stall_report(sampler, updates, args.slowest))
        print(
            f"wrote {out / 'stalls.txt'}"
            + (f" and {out}/torch_update_{args.torch_step}.txt" if args.torch_step else "")
        )


if __name__ == "__main__":
    main()
