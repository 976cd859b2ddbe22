"""The cyclic garbage collector's pauses inside the training loop, with the setup heap frozen (the default,
`agentrl/training/heap.py`) and without.

Runs `benchmarks/grpo_step.py`'s agentrl workload in a fresh process per setting, alternating, and counts every
collection the loop triggers (`gc.callbacks`): how many, their total pause, and the full (generation 2) ones,
which walk every tracked object the process holds.

    python benchmarks/gc_pauses.py --rounds 1 -- --model tiny:qwen2.5-0.5b-shape --dtype bfloat16 --device cpu \\
        --prompts 2 --n 2 --max-tokens 8 --steps 4 --micro-batch 4 --lora-rank 32
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(heap: str, grpo_argv: list[str]) -> dict:
    """One agentrl run of grpo_step's workload in this process; the loop's collections."""
    sys.path.insert(0, str(HERE))
    import grpo_step

    from agentrl.training import controller
    from agentrl.training import heap as heap_module

    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started[0]))

    frozen_count = [0]

    @contextlib.contextmanager
    def loop_heap():
        with heap_module.setup_objects_frozen() if heap == "frozen" else contextlib.nullcontext(0) as count:
            frozen_count[0] = count
            pauses.clear()  # setup's collections are not the loop's
            yield count

    controller.setup_objects_frozen = loop_heap
    gc.callbacks.append(on_collection)
    args = grpo_step.build_parser().parse_args([*grpo_argv, "--only", "agentrl", "--trainers", "agentrl"])
    result = grpo_step.run_agentrl(args)
    gc.callbacks.remove(on_collection)
    full = [seconds for generation, seconds in pauses if generation == 2]
    return {
        "heap": heap,
        "frozen_objects": frozen_count[0],
        "collections": len(pauses),
        "pause_s": sum(seconds for _, seconds in pauses),
        "full_collections_s": full,
        "step_s": result["step_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=1, help="each setting once per round, alternating")
    parser.add_argument("--only", choices=["frozen", "unfrozen"], help="internal: one run, print JSON")
    parser.add_argument(
        "grpo_argv", nargs=argparse.REMAINDER, help="after --: benchmarks/grpo_step.py's flags"
    )
    args = parser.parse_args()
    grpo_argv = [a for a in args.grpo_argv if a != "--"]
    if args.only:
        print("RESULT " + json.dumps(measure(args.only, grpo_argv)), flush=True)
        return
    print(
        "| heap | objects frozen | collections in the loop | their pause s | full collections s | median step s |"
    )
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for round_index in range(args.rounds):
        for heap in ("frozen", "unfrozen") if round_index % 2 == 0 else ("unfrozen", "frozen"):
            out = subprocess.run(
                [sys.executable, __file__, "--only", heap, "--", *grpo_argv], capture_output=True, text=True
            )
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if not lines:
                sys.exit(f"the {heap} run failed:\n{out.stderr[-3000:]}")
            r = json.loads(lines[0][len("RESULT ") :])
            print(
                f"| {r['heap']} | {r['frozen_objects']:,} | {r['collections']} | {r['pause_s']:.3f} | "
                f"{[round(s, 3) for s in r['full_collections_s']]} | {statistics.median(r['step_s']):.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
