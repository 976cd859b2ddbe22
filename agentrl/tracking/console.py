"""Console backend: one compact line per step with the numbers people watch during a run, and a second line
when rollouts failed (flow errors, timeouts, evaluator errors, each with its first reason: `failures.py`)."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path

from tqdm.auto import tqdm

from agentrl.tracking.failures import drain_failures, format_failure_line


def short_float(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.2e}"
    return f"{value:.4g}"


def format_console_line(metrics: Mapping[str, float], step: int) -> str:
    """One compact line with the numbers people watch: reward, validation, losses, speed, time."""
    parts = [f"step {step}"]
    named = (
        ("reward", "critic/full-score/mean"),
        ("pg_loss", "actor/pg_loss"),
        ("kl_loss", "actor/kl_loss"),
        ("entropy", "actor/entropy"),
        ("resp_len", "response_length/mean"),
        ("tok/s", "perf/throughput"),
    )
    for label, key in named:
        if key in metrics:
            parts.append(f"{label} {short_float(metrics[key])}")
    for key in sorted(k for k in metrics if k.startswith("val/")):
        parts.append(f"{key.removeprefix('val/test_score/')} {short_float(metrics[key])}")
    timings = sorted(k for k in metrics if k.startswith(("timing/", "timing_s/")))
    if timings:
        parts.append(" ".join(f"{k.split('/', 1)[1]} {short_float(metrics[k])}s" for k in timings))
    return " | ".join(parts)


class ConsoleBackend:
    """Prints one line per step to stdout, through tqdm so that open progress bars stay intact, and one more
    counting the step's failed rollouts when there were any."""

    def __init__(self) -> None:
        drain_failures()  # a run counts its own failures, not those of an earlier run in this process

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        tqdm.write(format_console_line(metrics, step), file=sys.stdout)
        if (failed := format_failure_line(drain_failures(), step)) is not None:
            tqdm.write(failed, file=sys.stdout)

    def log_params(self, params: Mapping[str, str]) -> None:
        pass

    def log_artifact(self, path: Path) -> None:
        pass

    def log_rollouts(self, records: list[dict], step: int) -> None:
        pass  # `agentrl rollouts RUN_DIR` prints them

    def finish(self, status: str) -> None:
        pass
