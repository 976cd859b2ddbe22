"""The CPU decode step's compiled layer, by the size hints Inductor compiled it with: on one thread or on all, the
loop nests that looked small when it was traced.

Inductor's C++ backend runs a loop nest on every thread only when its size hint, divided by the threads, reaches
`cpp.min_chunk_size` (512 elements by default); a smaller one runs on one thread while the others wait. The hints
are the sizes of the first trace, and the engine traces its decode layer before any request
(`SlotBatch.compile_now`) on small placeholders. This builds the embedded engine as `agentrl serve` does
(`compile_decode`), records the layer calls its compile makes and one real call of a served step (`--rows` rows
in `--groups` groups over a `--prefix`-token shared prefix, `benchmarks/serve_vs_vllm.py`'s workload), then
compiles the layer afresh in three forms, each traced on the engine's own compile calls first (so on the same
hints) or on the real call, and times the real call, the forms taking turns: medians of `--rounds` rounds of
`--calls` calls each.

    python benchmarks/decode_layer_hints.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from shared_prefix_decode import (
    add_workload_arguments,
    engine_waves,
)  # this folder is on the path when a benchmark runs as a script

from agentrl.rollout.engines import _compiled_steps
from agentrl.rollout.engines._compiled_steps import mark_layer_sizes
from agentrl.rollout.engines._slot_decode import slot_layer
from agentrl.rollout.engines.shared_prefix_attention import SharedPrefixMask

FORMS = {
    "engine's hints, Inductor's default chunk (512)": (512, "placeholders"),
    "engine's hints, every loop on every thread (1, shipped)": (1, "placeholders"),
    "real sizes' hints, Inductor's default chunk (512)": (512, "real"),
}


def record_layer_calls(rows: int) -> tuple[list[tuple], list[tuple]]:
    """Install a recording decode layer for the engine about to be built; (calls before any request, [the first
    call of a served step of `rows` rows sharing a prefix]), both filled as the engine runs."""
    compiled = mark_layer_sizes(_compiled_steps.compile_step_part(slot_layer, "inductor"))
    traced: list[tuple] = []
    real: list[tuple] = []

    def recording_layer(*args):
        if not real and isinstance(args[9], SharedPrefixMask) and args[2].shape[0] == rows:
            real.append(args)
        elif not real:
            traced.append(args)
        return compiled(*args)

    _compiled_steps._COMPILED["layer", "inductor"] = recording_layer
    return traced, real


def fresh_layer(number: int, min_chunk: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`slot_layer` compiled anew (a function of its own, so that Dynamo keeps nothing of another form's)."""
    namespace = {"slot_layer": slot_layer}
    exec(f"def layer_{number}(*args):\n    return slot_layer(*args)\n", namespace)
    compiled = torch.compile(namespace[f"layer_{number}"], options={"cpp.min_chunk_size": min_chunk})
    return mark_layer_sizes(compiled)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    traced, real = record_layer_calls(args.rows)
    engine_waves(
        argparse.Namespace(**vars(args), waves=1, compile_decode=True), {"served": lambda engine: None}
    )
    if not real:
        raise SystemExit(
            f"no decode step of {args.rows} rows sharing a prefix ran; try other --rows/--groups"
        )
    layers = {}
    with torch.inference_mode():
        for number, (name, (min_chunk, hints)) in enumerate(FORMS.items()):
            layers[name] = fresh_layer(number, min_chunk)
            for call in traced if hints == "placeholders" else real:
                layers[name](*call)
        medians: dict[str, list[float]] = {name: [] for name in layers}
        for _ in range(args.rounds):
            for name, layer in layers.items():
                times = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    layer(*real[0])
                    times.append(time.perf_counter() - start)
                medians[name].append(statistics.median(times) * 1000)
    print(
        f"{args.model}, {args.threads} torch thread(s): one decode layer over {args.rows} rows in {args.groups} "
        f"groups sharing {args.prefix} positions; traced first on the engine's {len(traced)} compile calls or on "
        f"the real call; medians of {args.rounds} rounds of {args.calls} calls, ms"
    )
    print("| form | ms a layer | rounds (min-max) |\n| --- | ---: | --- |")
    for name, values in medians.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f}-{max(values):.3f} |")


if __name__ == "__main__":
    main()
