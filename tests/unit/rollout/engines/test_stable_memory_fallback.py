"""Where the CUDA driver offers no virtual memory management, the engine allocates as before and says why once.
(The stable memory itself is tested on the GPU: tests/gpu/test_stable_memory.py.)"""

from __future__ import annotations

import logging

import torch

from agentrl.rollout.engines import _stable_memory
from agentrl.rollout.engines._stable_memory import stable_memory


def test_without_virtual_memory_management_nothing_is_reserved_and_the_reason_is_said_once(
    monkeypatch, caplog
):
    monkeypatch.setattr(
        _stable_memory, "_UNAVAILABLE", "the GPU or its driver lacks virtual memory management"
    )
    monkeypatch.setattr(_stable_memory, "_SAID", set())
    device = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger=_stable_memory.__name__):
        assert stable_memory(1 << 20, device, "the KV cache") is None
        assert stable_memory(1 << 21, device, "the KV cache") is None  # every growth and every sleep asks
        assert stable_memory(1 << 20, device, "an engine's own weights") is None
    assert [r.getMessage() for r in caplog.records] == [
        "embedded engine: no stable addresses for the KV cache, so CUDA graphs are captured again after each "
        "sleep: the GPU or its driver lacks virtual memory management",
        "embedded engine: no stable addresses for an engine's own weights, so CUDA graphs are captured again "
        "after each sleep: the GPU or its driver lacks virtual memory management",
    ]


def test_an_environment_variable_turns_it_off_without_asking_the_driver(monkeypatch):
    monkeypatch.setattr(_stable_memory, "_UNAVAILABLE", None)
    monkeypatch.setattr(_stable_memory, "_SAID", set())
    monkeypatch.setenv("AGENTRL_STABLE_MEMORY", "0")
    assert (
        _stable_memory.unavailable_reason(torch.device("cuda", 0)) == "turned off by AGENTRL_STABLE_MEMORY=0"
    )
    assert stable_memory(1 << 20, torch.device("cuda", 0), "the KV cache") is None
