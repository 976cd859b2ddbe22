"""Which samples reach the update: compact filtering by termination reason and rejection sampling.

Compact filtering (rLLM's `compact_filtering`) drops episodes that ended for a reason the user
marked with an `agent.compact_filtering.mask_*` flag, e.g. a response cut at the length limit,
whose reward says more about the limit than about the policy. Rejection sampling
(`agent.rejection_sample`) drops groups without learning signal, in one of two modes
(`agent.rejection_sample.mode`):

- `uniform_reward` (DAPO's dynamic sampling, Yu et al. 2025, arXiv:2503.14476): drop groups whose
  rewards are all equal; with a group baseline their advantages are all zero.
- `solve_partial` (rLLM's): keep only partially solved tasks, dropping those whose episodes are
  all `is_correct` or none is. Rewards may still differ inside a dropped group (partial credit,
  shaping); what counts is whether the task is solved.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch

from agentrl.algorithms._masked import index_groups
from agentrl.types import TerminationReason

__all__ = [
    "REJECTION_MODES",
    "SolveCounts",
    "build_masked_reasons",
    "compact_filter_keep",
    "compute_solve_counts",
    "count_termination_reasons",
    "rejection_keep_groups",
    "rejection_sample_keep",
    "solve_partial_keep_groups",
]

REJECTION_MODES = ("uniform_reward", "solve_partial")
"""Valid values of `agent.rejection_sample.mode`."""

_REASONS = tuple(r.value for r in TerminationReason)


def _reason_name(reason: str | TerminationReason, where: str) -> str:
    name = reason.value if isinstance(reason, TerminationReason) else reason
    if name not in _REASONS:
        raise ValueError(f"unknown termination reason {name!r} in {where}; allowed: {', '.join(_REASONS)}")
    return name


def build_masked_reasons(
    *,
    mask_max_prompt_length_exceeded: bool = False,
    mask_max_response_length_exceeded: bool = False,
    mask_env_done: bool = False,
    mask_max_turns_exceeded: bool = False,
    mask_timeout: bool = False,
    mask_unknown: bool = False,
    mask_error: bool = False,
) -> frozenset[str]:
    """The termination reasons to drop, from the `agent.compact_filtering.mask_*` flags.

    Each keyword is named after its config key and masks the `TerminationReason` whose value
    follows `mask_`; the controller passes the flags as they are.
    """
    flags = {
        TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED: mask_max_prompt_length_exceeded,
        TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED: mask_max_response_length_exceeded,
        TerminationReason.ENV_DONE: mask_env_done,
        TerminationReason.MAX_TURNS_EXCEEDED: mask_max_turns_exceeded,
        TerminationReason.TIMEOUT: mask_timeout,
        TerminationReason.UNKNOWN: mask_unknown,
        TerminationReason.ERROR: mask_error,
    }
    return frozenset(reason.value for reason, masked in flags.items() if masked)


def compact_filter_keep(
    termination_reasons: Sequence[str | TerminationReason],
    masked_reasons: Collection[str | TerminationReason],
) -> list[bool]:
    """keep[i] is False when sample i ended for one of `masked_reasons` (compact filtering).

    termination_reasons: one per sample (N,), `TerminationReason` members or their string values;
    masked_reasons: the reasons to drop (see `build_masked_reasons`). An unknown reason in either
    is a ValueError naming it, so a typo cannot silently keep everything.
    """
    masked = {_reason_name(r, "masked_reasons") for r in masked_reasons}
    return [
        _reason_name(r, f"termination_reasons[{i}]") not in masked for i, r in enumerate(termination_reasons)
    ]


def count_termination_reasons(termination_reasons: Sequence[str | TerminationReason]) -> dict[str, int]:
    """Samples per reason, every reason present (0 included): `batch/termination_reason/<reason>`."""
    counts = Counter(_reason_name(r, f"termination_reasons[{i}]") for i, r in enumerate(termination_reasons))
    return {reason: counts.get(reason, 0) for reason in _REASONS}


def _group_min_max(
    values: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if values.shape != group_ids.shape:
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected {tuple(values.shape)}")
    inverse, num_groups = index_groups(group_ids)
    values = values.double()
    lo = torch.full((num_groups,), float("inf"), dtype=values.dtype, device=values.device)
    hi = torch.full((num_groups,), float("-inf"), dtype=values.dtype, device=values.device)
    lo = lo.scatter_reduce(0, inverse, values, reduce="amin")
    hi = hi.scatter_reduce(0, inverse, values, reduce="amax")
    return inverse, lo, hi


def rejection_keep_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """keep (B,) bool: True for samples whose group's rewards are not all equal.

    rewards: (B,) float, one outcome reward per sample; group_ids: (B,) long, the sample's prompt.
    A group is kept when max(reward) > min(reward) within it: all-solved and none-solved groups
    are dropped, and so is a group of one (it has nothing to compare against).
    """
    inverse, lo, hi = _group_min_max(rewards, group_ids)
    return (hi > lo)[inverse]


def solve_partial_keep_groups(is_correct: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """keep (B,) bool: True for samples whose group (task) is partially solved.

    is_correct: (B,) bool, one per episode; group_ids: (B,) long, the episode's task. A group is
    kept when some but not all of its samples are correct (rLLM's rejection sampling): all-solved
    and none-solved tasks are dropped whatever their rewards, and so is a group of one.
    """
    inverse, lo, hi = _group_min_max(is_correct.bool(), group_ids)
    return ((lo == 0) & (hi == 1))[inverse]


def rejection_sample_keep(
    mode: str, *, rewards: torch.Tensor, is_correct: torch.Tensor, group_ids: torch.Tensor
) -> torch.Tensor:
    """keep (B,) bool for `agent.rejection_sample.mode`: `uniform_reward` looks at rewards (B,) float,
    `solve_partial` at is_correct (B,) bool; group_ids (B,) long in both."""
    if mode == "uniform_reward":
        return rejection_keep_groups(rewards, group_ids)
    if mode == "solve_partial":
        return solve_partial_keep_groups(is_correct, group_ids)
    raise ValueError(
        f"unknown rejection sampling mode {mode!r} (agent.rejection_sample.mode); allowed: {', '.join(REJECTION_MODES)}"
    )


class SolveCounts(NamedTuple):
    """Number of groups (not samples) by outcome; the controller logs each divided by their sum
    (fractions of tasks, as rLLM does) as `batch/solve_all`, `batch/solve_none`, `batch/solve_partial`."""

    solve_all: int
    solve_none: int
    solve_partial: int


def compute_solve_counts(is_correct: torch.Tensor, group_ids: torch.Tensor) -> SolveCounts:
    """Count groups in which every sample, no sample, or some samples were correct.

    is_correct: (B,) bool; group_ids: (B,) long. The three counts sum to the number of groups.
    """
    _inverse, lo, hi = _group_min_max(is_correct.bool(), group_ids)
    solve_all = int((lo == 1).sum())
    solve_none = int((hi == 0).sum())
    return SolveCounts(solve_all, solve_none, int(lo.numel()) - solve_all - solve_none)
