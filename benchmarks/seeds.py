"""One training command over several seeds, one after another: the gain in held-out accuracy and the wall time.

A learning figure from one run says little: where a warm start lands, and so what RL gains, depends on the seed.
This runs the command once per seed in a subprocess, with `trainer.seed=S data.seed=S` and a fresh run folder
`<out>/seed_S` appended, and prints a markdown table (held-out accuracy before the first RL step and after the
last one, the gain in points, the wall time) and the summary a README quotes: mean, min and max of the gain.

    python benchmarks/seeds.py --seeds 1 2 3 -- python cookbooks/tool_agent/train.py
    python benchmarks/seeds.py --seeds 1 2 3 --make-train          # `make train`'s run: configs/arithmetic.yaml
    python benchmarks/seeds.py --seeds 1 2 3 -- python cookbooks/math/train.py trainer.total_training_steps=20

The accuracies come from `<out>/seed_S/metrics.jsonl` (`val/accuracy` at step 0 and at the last validation),
else from the `held-out accuracy A -> B` line the cookbooks and `agentrl train` print. Where the run saved its
validation episodes (`rollouts/val_step_N.jsonl`), the gain's standard error is the paired one over the
held-out tasks: the standard deviation of (after - before) per task over the square root of their number. Each
seed's output is kept in `<out>/seed_S.log`. Runs go one at a time: on a small machine, parallel runs would change the wall
times and, through thread scheduling, nothing else.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MAKE_TRAIN = [sys.executable, "-m", "agentrl.cli", "train", "--config", "configs/arithmetic.yaml"]
"""What `make train` runs (the Makefile calls the `agentrl` console script of .venv)."""
SUMMARY_LINE = re.compile(r"held-out accuracy (\d+(?:\.\d+)?) -> (\d+(?:\.\d+)?)")


@dataclass
class SeedRun:
    seed: int
    before: float | None
    after: float | None
    episodes: int | None
    """Held-out episodes behind each accuracy (val/num_episodes), when metrics.jsonl has it."""
    gain_se: float | None
    """Paired standard error of the gain in points, from the saved validation episodes."""
    wall_s: float
    returncode: int

    @property
    def gain(self) -> float | None:
        """After minus before, in points (percent of the held-out tasks)."""
        if self.before is None or self.after is None:
            return None
        return 100.0 * (self.after - self.before)


def read_accuracies(
    run_dir: Path, output: str
) -> tuple[float | None, float | None, int | None, float | None]:
    """(before, after, held-out episodes, the gain's paired standard error in points): step 0's val/accuracy
    and the last one in metrics.jsonl, else the last `held-out accuracy A -> B` line of `output`."""
    validations = []
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        by_step: dict[int, dict] = {}
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
                by_step[int(record["step"])] = {**by_step.get(int(record["step"]), {}), **record}
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
        validations = [by_step[s] for s in sorted(by_step) if by_step[s].get("val/accuracy") is not None]
    if len(validations) >= 2 and min(r["step"] for r in validations) == 0:
        episodes = validations[-1].get("val/num_episodes")
        se = paired_standard_error(run_dir / "rollouts", int(validations[-1]["step"]))
        return validations[0]["val/accuracy"], validations[-1]["val/accuracy"], episodes and int(episodes), se
    found = SUMMARY_LINE.findall(output)
    if found:
        before, after = found[-1]
        return float(before), float(after), None, None
    return None, None, None, None


def paired_standard_error(rollouts: Path, last_step: int) -> float | None:
    """Standard error in points of the mean per-task change in correctness between the validation episodes of
    step 0 and of `last_step` (a task's episodes averaged); None unless both files hold the same tasks."""
    before, after = (_task_scores(rollouts / f"val_step_{step:06d}.jsonl") for step in (0, last_step))
    if not before or before.keys() != after.keys() or len(before) < 2:
        return None
    changes = [after[task] - before[task] for task in before]
    return 100.0 * statistics.stdev(changes) / len(changes) ** 0.5


def _task_scores(path: Path) -> dict[str, float]:
    scores: dict[str, list[float]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            episode = json.loads(line)
            scores.setdefault(episode["task_id"], []).append(float(bool(episode["is_correct"])))
    return {task: sum(v) / len(v) for task, v in scores.items()}


def run_seed(command: list[str], seed: int, out: Path, timeout: float | None) -> SeedRun:
    run_dir = out / f"seed_{seed}"
    argv = [*command, f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.default_local_dir={run_dir}"]
    print(f"seed {seed}: {' '.join(argv)}", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        output, returncode = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        returncode = -1
    wall = time.monotonic() - start
    (out / f"seed_{seed}.log").write_text(output)
    before, after, episodes, se = read_accuracies(run_dir, output)
    result = SeedRun(seed, before, after, episodes, se, wall, returncode)
    status = "ok" if returncode == 0 else f"exit {returncode} (log: {out / f'seed_{seed}.log'})"
    print(
        f"seed {seed}: {_accuracy(before)} -> {_accuracy(after)} in {_clock(wall)}, {status}", file=sys.stderr
    )
    return result


def render_table(runs: list[SeedRun]) -> str:
    """The markdown table, one row per seed, then the line to quote."""
    lines = [
        "| seed | held-out accuracy before RL | after RL | gain (points) | held-out episodes | wall |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        failed = "" if run.returncode == 0 else " (failed)"
        se = "" if run.gain_se is None else f" ± {run.gain_se:.1f}"
        lines.append(
            f"| {run.seed}{failed} | {_accuracy(run.before)} | {_accuracy(run.after)} | {_points(run.gain)}{se} "
            f"| {run.episodes or '-'} | {_clock(run.wall_s)} |"
        )
    return "\n".join([*lines, "", summary_line(runs)])


def summary_line(runs: list[SeedRun]) -> str:
    """`over seeds 1-3: +x on average, min +y, max +z; wall ...`."""
    gains = [r.gain for r in runs if r.gain is not None and r.returncode == 0]
    walls = [r.wall_s for r in runs]
    seeds = _seed_range([r.seed for r in runs])
    if not gains:
        return f"over seeds {seeds}: no run reported a held-out accuracy"
    missing = len(runs) - len(gains)
    note = f" ({missing} of {len(runs)} runs failed or reported nothing)" if missing else ""
    return (
        f"over seeds {seeds}: {_points(statistics.mean(gains))} on average, min {_points(min(gains))}, "
        f"max {_points(max(gains))}{note}; wall {_clock(statistics.mean(walls))} on average, "
        f"max {_clock(max(walls))}"
    )


def _seed_range(seeds: list[int]) -> str:
    if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def _accuracy(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _points(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], usage="%(prog)s [options] (--make-train | -- COMMAND ...)"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds to run (default 1 2 3)"
    )
    parser.add_argument("--make-train", action="store_true", help="run `make train`'s command")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the runs (default outputs/seeds/<time>); must be new",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds before a seed's run is stopped")
    args = parser.parse_args(own)
    if args.make_train == bool(command):
        parser.error("give either --make-train or a command after `--`")
    command = MAKE_TRAIN if args.make_train else command
    clashes = [
        a for a in command if a.split("=")[0] in ("trainer.seed", "data.seed", "trainer.default_local_dir")
    ]
    if clashes:
        parser.error(f"the command sets {', '.join(clashes)}; this script sets them per seed")
    out = args.out or Path("outputs/seeds") / time.strftime("%Y%m%d-%H%M%S")
    if out.exists() and any(out.iterdir()):
        parser.error(f"{out} is not empty: a run folder there would be resumed, not run afresh")
    out.mkdir(parents=True, exist_ok=True)
    runs = [run_seed(command, seed, out, args.timeout) for seed in args.seeds]
    print(f"`{' '.join(command)}` with trainer.seed=S data.seed=S:\n")
    print(render_table(runs))
    return 0 if all(r.returncode == 0 and r.gain is not None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
