"""The `smollm2-135m-instruct` preset converted once per test session, into a private cache.

Skipped with the reason when the wheel or `gguf` is missing (`make setup-smollm2`; `make test` installs them).
The conversion is counted: two resolves race, then a third comes after them, and `smollm2_converted.calls`
says how many conversions ran. Tests that resolve the name themselves (the trainer) point `AGENTRL_CACHE` at
`smollm2_converted.cache` with `monkeypatch.setenv`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentrl.models import SMOLLM2_NAME, resolve_model_path
from agentrl.models import smollm2 as smollm2_lib


@dataclass
class Converted:
    cache: Path
    path: str
    calls: int
    resolved: list[str]


@pytest.fixture(scope="session")
def smollm2_converted(tmp_path_factory) -> Converted:
    missing = smollm2_lib.missing_requirements()
    if missing:
        pytest.skip(f"{SMOLLM2_NAME} needs {' and '.join(missing)}: run `make setup-smollm2`")
    cache = tmp_path_factory.mktemp("smollm2_cache")
    calls = []
    convert = smollm2_lib.convert_gguf

    def counted(gguf_path, folder):
        calls.append(folder)
        convert(gguf_path, folder)

    old_cache = os.environ.get("AGENTRL_CACHE")
    os.environ["AGENTRL_CACHE"] = str(cache)
    smollm2_lib.convert_gguf = counted
    resolved: list[str] = []
    try:
        racers = [
            threading.Thread(target=lambda: resolved.append(resolve_model_path(SMOLLM2_NAME)))
            for _ in range(2)
        ]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join()
        resolved.append(resolve_model_path(SMOLLM2_NAME))
    finally:
        smollm2_lib.convert_gguf = convert
        if old_cache is None:
            os.environ.pop("AGENTRL_CACHE", None)
        else:
            os.environ["AGENTRL_CACHE"] = old_cache
    assert len(resolved) == 3, "a resolve failed (its thread's traceback is above)"
    return Converted(cache=cache, path=resolved[-1], calls=len(calls), resolved=resolved)


@pytest.fixture
def smollm2_cache_env(smollm2_converted, monkeypatch) -> Converted:
    """`AGENTRL_CACHE` points at the session's converted preset for this test."""
    monkeypatch.setenv("AGENTRL_CACHE", str(smollm2_converted.cache))
    return smollm2_converted
