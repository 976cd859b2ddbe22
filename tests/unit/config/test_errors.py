"""ConfigError: every problem in the message, one per line, and it survives pickling (Ray, subprocesses)."""

from __future__ import annotations

import pickle

from agentrl.config import ConfigError


def test_config_error_renders_every_problem():
    err = ConfigError(["a.b=1 is bad", "c.d=2 is bad"])
    assert str(err) == "invalid configuration (2 problems):\n  - a.b=1 is bad\n  - c.d=2 is bad"
    assert str(ConfigError("x.y missing")) == "invalid configuration (1 problem):\n  - x.y missing"


def test_config_error_pickles_with_its_problems():
    err = pickle.loads(pickle.dumps(ConfigError(["a.b=1 is bad", "c.d=2 is bad"])))
    assert isinstance(err, ConfigError) and err.problems == ["a.b=1 is bad", "c.d=2 is bad"]
