"""launch_vllm_servers failure paths: a clear error with the server's last log lines, nothing left running;
the dtype rule on a real vLLM server (`auto` keeps bfloat16 where its first generation works)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest

from agentrl.rollout.admin_auth import admin_headers, process_admin_token
from agentrl.rollout.engines.vllm import VLLMStartupError, launch_vllm_servers

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def test_missing_interpreter_names_the_config_key(tmp_path: Path) -> None:
    with pytest.raises(VLLMStartupError, match=r"rollout\.vllm\.python.*make setup-vllm"):
        launch_vllm_servers(str(tmp_path), 1, python=str(tmp_path / "nope" / "python"), log_dir=tmp_path)


@pytest.mark.slow
@pytest.mark.vllm
def test_server_that_cannot_start_raises_with_its_log_tail(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build the vLLM environment with `make setup-vllm`")
    bad_model = tmp_path / "not-a-model"
    bad_model.mkdir()
    with pytest.raises(VLLMStartupError) as info:
        launch_vllm_servers(str(bad_model), 1, python=str(VLLM_PYTHON), startup_timeout=120, log_dir=tmp_path)
    message = str(info.value)
    assert "exited with code" in message and "last lines of" in message
    assert str(bad_model) in message  # vLLM's own complaint about the folder, from its log
    log = next(tmp_path.glob("vllm_*.log"))
    port = log.stem.split("_")[1]
    assert f"port {port}" in message
    for entry in Path("/proc").iterdir():  # the failed server's process group is gone
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            assert f"--port {port} " not in cmd, cmd


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    match = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(match.group(1).split()) if match else set()


@pytest.mark.slow
@pytest.mark.vllm
def test_auto_dtype_keeps_bfloat16_where_the_first_generation_works(tmp_path: Path, caplog) -> None:
    """`auto` launches in bfloat16 and keeps it after the one-token probe (~30 s). Only a CPU with
    avx512_bf16/amx_bf16 may fall back to float32 (issue 21), and then with one warning line; this
    host's AMD EPYC has neither flag, so here bfloat16 must stay. The crash itself is simulated in
    test_vllm_dtype_probe.py."""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build the vLLM environment with `make setup-vllm`")
    from agentrl.models import resolve_model_path

    caplog.set_level(logging.WARNING, logger="agentrl.rollout.engines.vllm")
    with launch_vllm_servers(
        resolve_model_path("tiny:qwen2"), 1, python=str(VLLM_PYTHON), served_model_name="tiny:qwen2",
        max_model_len=256, dtype="auto", enable_lora=False, max_num_seqs=4, startup_timeout=240,
        log_dir=tmp_path,
    ) as servers:  # fmt: skip
        (server,) = servers
        assert server.is_running() and servers.dtype == server.dtype
        assert f"--dtype {server.dtype} " in " ".join(server.process.args) + " "
        assert re.search(r'"POST /v1/completions HTTP/1\.1" 200', server.log_path.read_text())  # the probe
        # vLLM's own guard carries the run's token (VLLM_API_KEY): its /v1 routes refuse a caller without it
        body = {"model": "tiny:qwen2", "prompt": "Hi", "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 401
        headers = admin_headers(process_admin_token())
        assert (
            httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60).status_code
            == 200
        )
    warnings = [r.getMessage() for r in caplog.records if r.name == "agentrl.rollout.engines.vllm"]
    if {"avx512_bf16", "amx_bf16"} & _cpu_flags() and server.dtype == "float32":
        assert len(warnings) == 1 and "bfloat16 killed the server" in warnings[0]
    else:
        assert server.dtype == "bfloat16" and warnings == []
