"""The vLLM launcher's dtype rule (issue 21): after /health, a one-token generation probe; `auto` falls back.

On some x86 CPUs (avx512_bf16/amx_bf16) vLLM's bfloat16 kernels die with SIGILL at the first generation
while `/health` says ok. The launcher is run for real against `fake_vllm_server.py`, a server process
started through a stand-in interpreter with vLLM's command line: it answers /health and one token, or
its first generation kills it (SIGILL in the server itself, or in an "engine core" child after which it
answers vLLM's EngineDeadError 500 and exits) when its `--dtype` is in `$FAKE_VLLM_CRASH_DTYPES`.
A second each; the real vLLM case is in test_vllm_launcher.py.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

from agentrl.rollout.engines import vllm as launcher
from agentrl.rollout.engines.vllm import VLLMStartupError, dtype_plan, launch_vllm_servers

FAKE_SERVER = Path(__file__).with_name("fake_vllm_server.py")
LOGGER = "agentrl.rollout.engines.vllm"


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    """An 'interpreter' that runs the fake server with the launcher's arguments (same process: exec)."""
    path = tmp_path / "bin" / "python"
    path.parent.mkdir()
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVER}" "$@"\n')
    path.chmod(0o755)
    return str(path)


def launch(fake_python: str, tmp_path: Path, dtype: str, n: int = 1):
    return launch_vllm_servers(
        str(tmp_path / "model"), n, python=fake_python, served_model_name="tiny", dtype=dtype,
        startup_timeout=60, log_dir=tmp_path / "logs",
    )  # fmt: skip


def launched(tmp_path: Path) -> dict[int, str]:
    """port -> the dtype a server was started with, from the fake servers' first log lines."""
    found = {}
    for log in (tmp_path / "logs").glob("vllm_*.log"):
        match = re.search(r"fake vLLM: port (\d+), dtype (\w+)", log.read_text())
        assert match, log.read_text()
        found[int(match.group(1))] = match.group(2)
    return found


def assert_no_server_left(ports) -> None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            for port in ports:
                assert not (str(FAKE_SERVER) in cmd and f"--port {port} " in cmd), cmd


def test_dtype_plan() -> None:
    assert dtype_plan("auto", cuda=False) == ("bfloat16", "float32")
    assert dtype_plan("auto", cuda=True) == ("bfloat16", None)  # on GPUs auto is plain bfloat16
    for dtype in ("bfloat16", "float32", "float16"):
        assert dtype_plan(dtype, cuda=False) == (dtype, None)


def test_auto_keeps_bfloat16_when_the_probe_passes(fake_python, tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with launch(fake_python, tmp_path, "auto", n=2) as servers:
        assert servers.dtype == "bfloat16" and [s.dtype for s in servers] == ["bfloat16", "bfloat16"]
        assert all(s.is_running() for s in servers)
        for server in servers:  # the probe reached each server
            assert '"POST /v1/completions HTTP/1.1" 200' in server.log_path.read_text()
    assert sorted(launched(tmp_path).values()) == ["bfloat16", "bfloat16"]
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert_no_server_left(launched(tmp_path))


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("signal", ["exit code -4 (SIGILL)", "Illegal instruction"]),
        ("engine-dead", ["exit code 1", "EngineCore encountered an issue", "(exit code: -4)"]),
    ],
)
def test_auto_relaunches_in_float32_when_bfloat16_kills_the_server(
    fake_python, tmp_path, caplog, monkeypatch, how, says
) -> None:
    monkeypatch.setenv("FAKE_VLLM_CRASH_DTYPES", "bfloat16")
    monkeypatch.setenv("FAKE_VLLM_CRASH_HOW", how)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with launch(fake_python, tmp_path, "auto", n=2) as servers:
        assert servers.dtype == "float32" and [s.dtype for s in servers] == ["float32", "float32"]
        assert all(s.is_running() for s in servers)
        ports = {s.port for s in servers}
    started = launched(tmp_path)
    assert sorted(started.values()) == ["bfloat16", "bfloat16", "float32", "float32"]
    assert {p for p, d in started.items() if d == "float32"} == ports
    (record,) = [r for r in caplog.records if r.name == LOGGER]  # one line says why
    line = record.getMessage()
    assert record.levelno == logging.WARNING and "\n" not in line
    assert line.startswith("vLLM dtype auto: bfloat16 killed the server on port ")
    assert "relaunching in float32" in line and "actor_rollout_ref.rollout.vllm.dtype=float32" in line
    for text in says:
        assert text in line, line
    assert_no_server_left(started)


def test_explicit_bfloat16_that_crashes_is_a_startup_error(
    fake_python, tmp_path, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("FAKE_VLLM_CRASH_DTYPES", "bfloat16")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with pytest.raises(VLLMStartupError) as info:
        launch(fake_python, tmp_path, "bfloat16", n=2)
    message = str(info.value)
    assert "passed its health check but died at its first generation in bfloat16" in message
    assert "exit code -4 (SIGILL)" in message and "avx512_bf16" in message
    assert "set actor_rollout_ref.rollout.vllm.dtype=float32" in message
    assert "Illegal instruction (fake bfloat16 kernel)" in message  # the log tail
    started = launched(tmp_path)
    assert sorted(started.values()) == ["bfloat16", "bfloat16"]  # no fallback for an explicit dtype
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert_no_server_left(started)


def test_auto_on_cuda_is_bfloat16_without_fallback(fake_python, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(launcher, "_cuda_available", lambda: True)
    monkeypatch.setenv("FAKE_VLLM_CRASH_DTYPES", "bfloat16")
    with pytest.raises(VLLMStartupError, match=r"dtype=auto, which is bfloat16 on CUDA"):
        launch(fake_python, tmp_path, "auto")
    assert list(launched(tmp_path).values()) == ["bfloat16"]


def test_auto_whose_float32_fallback_crashes_too_says_so(fake_python, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_CRASH_DTYPES", "bfloat16,float32")
    with pytest.raises(VLLMStartupError, match=r"in float32 as well .*after bfloat16 did") as info:
        launch(fake_python, tmp_path, "auto")
    assert "Illegal instruction" in str(info.value)
    assert sorted(launched(tmp_path).values()) == ["bfloat16", "float32"]
    assert_no_server_left(launched(tmp_path))
