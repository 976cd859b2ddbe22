"""Fixtures: a private model cache per test session, and the tiny presets built into it once."""

import os

import pytest

from agentrl.models import resolve_model_path


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """Point AGENTRL_CACHE at a fresh folder so tests build (and never reuse a stale) tiny model."""
    cache = tmp_path_factory.mktemp("agentrl_cache")
    old = os.environ.get("AGENTRL_CACHE")
    os.environ["AGENTRL_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("AGENTRL_CACHE", None)
    else:
        os.environ["AGENTRL_CACHE"] = old


@pytest.fixture(scope="session")
def mini_path(model_cache):
    return resolve_model_path("tiny:qwen2-mini")


@pytest.fixture(scope="session")
def qwen2_path(model_cache):
    return resolve_model_path("tiny:qwen2")


@pytest.fixture(scope="session")
def vl_path(model_cache):
    return resolve_model_path("tiny:qwen2-vl")


@pytest.fixture(scope="session")
def vl3_path(model_cache):
    return resolve_model_path("tiny:qwen3-vl")
