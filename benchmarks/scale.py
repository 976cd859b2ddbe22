"""One GRPO workload over N devices: weak scaling (fixed batch per device) and strong scaling (fixed global batch).

Every configuration is one `benchmarks/grpo_step.py --only agentrl` run in its own process (its own Ray, engine
and peak memory) on the Ray backend with `trainer.n_gpus_per_node=N`: N policy workers, each an FSDP2 rank with
its own embedded engine (the pool spreads sessions over the N engines). Weak scaling runs
`--prompts-per-device x N` prompts per step, strong scaling `--global-prompts`; each prompt gets `--n` answers of
exactly `--max-tokens` tokens (EOS masked), one optimizer step per step.

Per configuration, from the steps after the first (warm-up): step, generation (`timing/gen`) and update
(`timing/update_actor`) seconds; generated tokens per second per device, in generation and in the update (the
same tokens, trained on); scaling efficiency against the fewest devices (weak: per-device generation throughput
relative to it; strong: speed-up over the device ratio); and the first update's `actor/pg_loss` and
`actor/grad_norm` and `actor/entropy`, which strong scaling must reproduce at every N (same prompts, same per-call
seeds; with answers of equal length the first token-mean pg_loss is zero up to rounding). Prints a
markdown table and one JSON line per row; `--out FILE` writes the rows as JSON.

    python benchmarks/scale.py --model tiny:qwen2.5-0.5b-shape --dtype bfloat16             # GPUs: all visible
    python benchmarks/scale.py --devices 1 2 4 8 --prompts-per-device 8 --global-prompts 32   # GPUs: chosen
    python benchmarks/scale.py --device cpu --model tiny:qwen2 --dtype float32 --devices 1 2 \\
        --prompts-per-device 2 --n 4 --max-tokens 8 --steps 3                                  # CPU smoke (gloo)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

GRPO_STEP = Path(__file__).resolve().parent / "grpo_step.py"
COLUMNS = [  # title, row key, format
    ("mode", "mode", ""),
    ("devices", "devices", "d"),
    ("prompts", "prompts", "d"),
    ("rows", "rows", "d"),
    ("step s", "step_s", ".2f"),
    ("gen s", "gen_s", ".2f"),
    ("update s", "update_s", ".2f"),
    ("gen tok/s/dev", "gen_tokens_per_s_per_device", ".0f"),
    ("update tok/s/dev", "update_tokens_per_s_per_device", ".0f"),
    ("efficiency", "efficiency", ".2f"),
    ("first pg_loss", "first_pg_loss", ".3g"),
    ("first grad_norm", "first_grad_norm", ".7g"),
    ("first entropy", "first_entropy", ".7g"),
    ("peak GiB", "peak_gib", ".1f"),
]


def default_devices(visible: int) -> list[int]:
    """1, 2, 4, ... up to the visible device count, and that count itself (1 when there is none)."""
    counts = [1]
    while counts[-1] * 2 <= visible:
        counts.append(counts[-1] * 2)
    return counts if visible <= counts[-1] else [*counts, visible]


def plan(
    devices: list[int], modes: list[str], per_device: int, global_prompts: int
) -> list[tuple[str, int, int]]:
    """(mode, devices, prompts per step) of every configuration, weak scaling first."""
    return [
        (mode, count, per_device * count if mode == "weak" else global_prompts)
        for mode in modes
        for count in devices
    ]


def micro_batch(rows: int, devices: int, largest: int) -> int:
    """Rows per forward/backward on one device: the largest divisor of the rows per device within `largest`."""
    per_device = rows // devices
    return max(d for d in range(1, min(largest, per_device) + 1) if per_device % d == 0)


def run_config(args: argparse.Namespace, devices: int, prompts: int) -> dict:
    """One grpo_step.py run of the agentrl side on `devices` Ray workers; returns its RESULT."""
    rows = prompts * args.n
    if rows % devices:
        sys.exit(f"{prompts} prompts x {args.n} answers = {rows} rows do not split over {devices} devices")
    command = [
        sys.executable, str(GRPO_STEP), "--only", "agentrl",
        "--model", args.model, "--dtype", args.dtype, "--device", args.device,
        "--prompts", str(prompts), "--n", str(args.n), "--max-tokens", str(args.max_tokens),
        "--micro-batch", str(micro_batch(rows, devices, args.micro_batch)), "--steps", str(args.steps),
        "--extra", "trainer.backend=ray", f"trainer.n_gpus_per_node={devices}", *args.set,
    ]  # fmt: skip
    done = subprocess.run(command, text=True, stdout=subprocess.PIPE)  # its log goes to stderr as it runs
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not results:
        sys.exit(
            f"{devices} devices, {prompts} prompts failed (exit {done.returncode}); its log is above, "
            f"the end of its output:\n{done.stdout[-3000:]}"
        )
    return json.loads(results[-1][len("RESULT ") :])


def summarise(mode: str, devices: int, prompts: int, n: int, result: dict) -> dict:
    """One table row from a run's RESULT: medians over the measured steps."""
    gen_s, update_s = statistics.median(result["gen_s"]), statistics.median(result["update_s"])
    tokens = statistics.median(result["tokens"])
    first = result["first_update"]
    return {
        "mode": mode,
        "devices": devices,
        "prompts": prompts,
        "rows": prompts * n,
        "step_s": statistics.median(result["step_s"]),
        "gen_s": gen_s,
        "update_s": update_s,
        "gen_tokens_per_s_per_device": tokens / gen_s / devices,
        "update_tokens_per_s_per_device": tokens / update_s / devices,
        "first_pg_loss": first["actor/pg_loss"],
        "first_grad_norm": first["actor/grad_norm"],
        "first_entropy": first["actor/entropy"],
        "peak_gib": result["peak_gib"] or None,  # none measured on CPU
        "steps_measured": len(result["step_s"]),
    }


def add_efficiency(rows: list[dict]) -> None:
    """Weak: per-device generation throughput over the fewest devices'. Strong: speed-up over the device ratio."""
    for mode in ("weak", "strong"):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        base = min(mine, key=lambda r: r["devices"])
        for r in mine:
            if mode == "weak":
                r["efficiency"] = r["gen_tokens_per_s_per_device"] / base["gen_tokens_per_s_per_device"]
            else:
                r["efficiency"] = (base["step_s"] / r["step_s"]) / (r["devices"] / base["devices"])


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table_lines(rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(title for title, _, _ in COLUMNS) + " |"]
    lines.append("| --- | " + " | ".join("---:" for _ in COLUMNS[1:]) + " |")
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(key), spec) for _, key, spec in COLUMNS) + " |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", help="device counts (default: 1, 2, 4, ... all visible)")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when visible, else cpu (gloo)")
    p.add_argument("--modes", nargs="+", choices=["weak", "strong"], default=["weak", "strong"])
    p.add_argument("--model", default="tiny:qwen2.5-0.5b-shape")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--prompts-per-device", type=int, default=8, help="weak scaling: prompts per step per device"
    )
    p.add_argument(
        "--global-prompts",
        type=int,
        help="strong scaling: prompts per step (default: per device x most devices)",
    )
    p.add_argument("--n", type=int, default=8, help="answers per prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer")
    p.add_argument("--micro-batch", type=int, default=64, help="most rows per forward/backward on one device")
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is left out of the medians")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a Hydra override of every run"
    )
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.device is None or args.devices is None:
        import torch

        visible = torch.cuda.device_count()
        args.device = args.device or ("cuda" if visible else "cpu")
        args.devices = args.devices or default_devices(visible if args.device == "cuda" else 1)
    args.global_prompts = args.global_prompts or args.prompts_per_device * max(args.devices)
    results: dict[tuple[int, int], dict] = {}  # a strong config equal to a weak one runs once
    rows = []
    for mode, devices, prompts in plan(
        args.devices, args.modes, args.prompts_per_device, args.global_prompts
    ):
        if (devices, prompts) not in results:
            results[devices, prompts] = run_config(args, devices, prompts)
        rows.append(summarise(mode, devices, prompts, args.n, results[devices, prompts]))
    add_efficiency(rows)
    print(
        f"\n{args.model} {args.dtype} on {args.device}: {args.n} answers x {args.max_tokens} tokens per prompt; "
        f"weak {args.prompts_per_device} prompts per device, strong {args.global_prompts} prompts; "
        + ("step 2" if args.steps == 2 else f"medians of steps 2-{args.steps}")
    )
    for line in table_lines(rows):
        print(line)
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2)
        )
    return rows


if __name__ == "__main__":
    main()
