"""launch_vllm_servers failure paths: a clear error with the server's last log lines, nothing left running."""

from __future__ import annotations

from pathlib import Path

import pytest

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
