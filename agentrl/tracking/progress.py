"""Progress bars for the rollout, update and validation phases (tqdm on stderr)."""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm

from agentrl.tracking.console import short_float


def progress_bar(desc: str, total: int, *, leave: bool = False) -> tqdm:
    """A tqdm bar on stderr for rollout, update and validation phases.

    Shown when stderr is a terminal; `AGENTRL_PROGRESS=1` forces it on (logs, CI), `=0` off.
    Callers report progress with `bar.update(n)` and the numbers with `set_progress_postfix`.
    """
    flag = os.environ.get("AGENTRL_PROGRESS", "").strip().lower()
    if flag in ("1", "true", "yes", "on"):
        disable = False
    elif flag in ("0", "false", "no", "off"):
        disable = True
    else:
        disable = not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=disable, leave=leave, dynamic_ncols=True)


def set_progress_postfix(
    bar: tqdm, *, step: int, reward: float | None = None, throughput: float | None = None
) -> None:
    """Show `step`, `reward` and `tok/s` (in that order) after the bar, via `bar.set_postfix`."""
    stats: dict[str, str] = {"step": str(step)}
    if reward is not None:
        stats["reward"] = short_float(float(reward))
    if throughput is not None:
        stats["tok/s"] = f"{float(throughput):.0f}"
    bar.set_postfix(stats)
