"""Fixtures for config tests: build nested config dicts from dotted keys, collect ConfigError problems."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agentrl.config import ConfigError, validate_config


def _nested(dotted: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


@pytest.fixture
def nested() -> Callable[[dict[str, Any]], dict[str, Any]]:
    """{"a.b.c": 1} -> {"a": {"b": {"c": 1}}}."""
    return _nested


@pytest.fixture
def problems_for() -> Callable[[dict[str, Any]], list[str]]:
    """The problems validate_config reports for these dotted values (on top of the defaults)."""

    def _problems(dotted: dict[str, Any]) -> list[str]:
        with pytest.raises(ConfigError) as info:
            validate_config(_nested(dotted))
        return info.value.problems

    return _problems
