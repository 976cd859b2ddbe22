"""Compact filtering by termination reason, rejection sampling and solve counts."""

import pytest
import torch

from agentrl.algorithms import (
    REJECTION_MODES,
    build_masked_reasons,
    compact_filter_keep,
    compute_solve_counts,
    count_termination_reasons,
    rejection_keep_groups,
    rejection_sample_keep,
    solve_partial_keep_groups,
)
from agentrl.types import TerminationReason

ALL_REASONS = [r.value for r in TerminationReason]


def test_compact_filter_keep_hand_case():
    reasons = ["env_done", TerminationReason.TIMEOUT, "max_response_length_exceeded", "error"]
    keep = compact_filter_keep(reasons, {"timeout", TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED})
    assert keep == [True, False, False, True]
    assert compact_filter_keep(reasons, set()) == [True] * 4


@pytest.mark.parametrize("reason", ALL_REASONS)
def test_each_mask_flag_drops_exactly_its_reason(reason):
    masked = build_masked_reasons(**{f"mask_{reason}": True})
    assert masked == {reason}
    keep = compact_filter_keep(ALL_REASONS, masked)
    assert keep == [r != reason for r in ALL_REASONS]


def test_build_masked_reasons_defaults_to_nothing():
    assert build_masked_reasons() == frozenset()
    assert build_masked_reasons(mask_timeout=True, mask_error=True) == {"timeout", "error"}


def test_unknown_reason_is_an_error():
    with pytest.raises(ValueError, match="unknown termination reason 'time_out' in masked_reasons"):
        compact_filter_keep(["timeout"], {"time_out"})
    with pytest.raises(ValueError, match=r"termination_reasons\[1\]"):
        compact_filter_keep(["timeout", "oops"], set())


def test_count_termination_reasons():
    counts = count_termination_reasons(["timeout", "env_done", TerminationReason.TIMEOUT])
    assert counts["timeout"] == 2 and counts["env_done"] == 1 and counts["error"] == 0
    assert set(counts) == set(ALL_REASONS)


def test_rejection_keep_groups_hand_case():
    # group 7: [1, 1] all solved -> drop; group 3: [0, 0] none solved -> drop
    # group 5: [1, 0] mixed -> keep; group 2: [0.5] singleton -> drop; group 9: [0.2, 0.2, 0.7] -> keep
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.5, 0.2, 0.2, 0.7, 0.0])
    groups = torch.tensor([7, 3, 7, 3, 5, 2, 9, 9, 9, 5])
    keep = rejection_keep_groups(rewards, groups)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, False, False, False, True, False, True, True, True, True]


def test_rejection_keep_groups_shape_error():
    with pytest.raises(ValueError, match="group_ids"):
        rejection_keep_groups(torch.zeros(3), torch.zeros(4).long())


def test_compute_solve_counts_hand_case():
    # group 0: [T, T] all; group 1: [F, F] none; group 2: [T, F] partial; group 3: [T] all
    is_correct = torch.tensor([True, True, False, False, True, False, True])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    counts = compute_solve_counts(is_correct, groups)
    assert counts == (2, 1, 1)
    assert (counts.solve_all, counts.solve_none, counts.solve_partial) == (2, 1, 1)


def test_solve_partial_keep_groups_hand_case():
    # group 0: [T, T] all solved -> drop; group 1: [F, F] none -> drop; group 2: [T, F] -> keep;
    # group 3: [T] alone -> drop (all solved)
    is_correct = torch.tensor([True, True, False, False, True, False, True])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    keep = solve_partial_keep_groups(is_correct, groups)
    assert keep.tolist() == [False, False, False, False, True, True, False]


def test_rejection_sample_keep_dispatches_on_mode_and_names_the_key():
    rewards, is_correct, groups = torch.tensor([1.0, 0.5]), torch.tensor([True, True]), torch.tensor([0, 0])
    assert rejection_sample_keep(
        "uniform_reward", rewards=rewards, is_correct=is_correct, group_ids=groups
    ).all()
    assert not rejection_sample_keep(
        "solve_partial", rewards=rewards, is_correct=is_correct, group_ids=groups
    ).any()
    assert REJECTION_MODES == ("uniform_reward", "solve_partial")
    with pytest.raises(ValueError, match="agent.rejection_sample.mode"):
        rejection_sample_keep("dapo", rewards=rewards, is_correct=is_correct, group_ids=groups)
