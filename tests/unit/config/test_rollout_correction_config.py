"""algorithm.rollout_correction: defaults, accepted values, and errors that name the key."""

from __future__ import annotations

import typing

import pytest

from agentrl.algorithms.rollout_correction import TIS_MODES
from agentrl.config import AgentRLConfig, validate_config
from agentrl.config.schema import RolloutCorrectionConfig


def test_defaults_off_with_cap_two():
    rc = AgentRLConfig().algorithm.rollout_correction
    assert rc.tis_mode is None and rc.tis_cap == 2.0


@pytest.mark.parametrize("mode", [*TIS_MODES, None])
def test_every_mode_is_accepted(mode):
    cfg = validate_config({"algorithm": {"rollout_correction": {"tis_mode": mode, "tis_cap": 1.5}}})
    assert cfg.algorithm.rollout_correction.tis_mode == mode
    assert cfg.algorithm.rollout_correction.tis_cap == 1.5


def test_schema_modes_are_the_algorithm_modes():
    (literal, _none) = typing.get_args(RolloutCorrectionConfig.model_fields["tis_mode"].annotation)
    assert typing.get_args(literal) == TIS_MODES


def test_unknown_mode_names_the_key(problems_for):
    (message,) = problems_for({"algorithm.rollout_correction.tis_mode": "tokens"})
    assert message.startswith("algorithm.rollout_correction.tis_mode='tokens' is invalid")
    assert "'token' or 'sequence'" in message and "did you mean 'token'?" in message


@pytest.mark.parametrize("cap", [0, -1.0])
def test_non_positive_cap_names_the_key(problems_for, cap):
    (message,) = problems_for({"algorithm.rollout_correction.tis_cap": cap})
    assert message.startswith(f"algorithm.rollout_correction.tis_cap={cap!r} is invalid")
    assert "greater than 0" in message


def test_unknown_key_is_refused(problems_for):
    (message,) = problems_for({"algorithm.rollout_correction.rollout_is": "token"})
    assert "algorithm.rollout_correction.rollout_is" in message
