"""`agentrl serve` as a user runs it: start, health, a chat call, traces with the admin token from the file it
printed, Ctrl-C, nothing left behind (the token file included)."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentrl.rollout.engines.vllm import group_alive

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def _start_serve(args: list[str], timeout: float) -> tuple[subprocess.Popen, str, list[str]]:
    """The process, its gateway URL and what it printed, up to the admin token file's line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    base = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"behind the gateway at (http://[\d.]+:\d+)", line):
            base = m.group(1)
        if base and "admin token file" in line:
            return proc, base, lines
    proc.kill()
    raise AssertionError("agentrl serve did not print its base URL and token file:\n" + "".join(lines))


def _token_file(lines: list[str]) -> Path:
    return Path(
        next(re.search(r"admin token file.*?:\s+(\S+)", line)[1] for line in lines if "token file" in line)
    )


def _admin(lines: list[str]) -> dict[str, str]:
    """The header an admin call needs: the token from the file `agentrl serve` printed."""
    return {"Authorization": f"Bearer {_token_file(lines).read_text()}"}


def _interrupt(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    return out


def test_serve_embedded_two_servers(tmp_path: Path) -> None:
    proc, base, lines = _start_serve(
        ["--model", "tiny:qwen2-mini", "--servers", "2", "--max-tokens", "5", "--log-dir", str(tmp_path)], 120
    )
    token_file = _token_file(lines)
    try:
        usage = "".join(lines)
        assert f"{base}/sessions/<id>/v1" in usage and f"GET {base}/sessions/<id>/traces" in usage
        assert token_file.parent == tmp_path and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert token_file.read_text() not in usage  # the path is printed, never the token
        metrics = re.findall(r"GET (http://\S+/metrics)", usage)
        assert len(metrics) == 2 and base not in metrics[0]  # each server's own, not the gateway's
        assert "vllm:time_to_first_token_seconds_count" in httpx.get(metrics[0]).text
        health = httpx.get(f"{base}/health").json()
        assert health["status"] == "ok" and len(health["servers"]) == 2
        # compiled by default, as vLLM serves (`--enforce-eager` above turns it off)
        assert httpx.get(f"{health['servers'][0]['url']}/stats", timeout=30).json()["compile_decode"] is True
        r = httpx.post(
            f"{base}/sessions/demo/v1/chat/completions",
            json={"model": "tiny:qwen2-mini", "messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert httpx.get(f"{base}/sessions/demo/traces").status_code == 401
        traces = httpx.get(f"{base}/sessions/demo/traces", headers=_admin(lines)).json()
        assert len(traces) == 1 and 1 <= len(traces[0]["response_ids"]) <= 5
        assert len(traces[0]["logprobs"]) == len(traces[0]["response_ids"])
    finally:
        out = _interrupt(proc)
    assert proc.returncode == 0, out
    assert "stopping" in out
    assert not group_alive(proc.pid)
    assert not token_file.exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health", timeout=2)


def test_serve_passes_vllms_prefill_flags_to_the_embedded_engine(tmp_path: Path) -> None:
    """`--no-enable-chunked-prefill --max-num-batched-tokens 48 --enforce-eager` as `vllm serve` takes them, and
    V0's `--num-scheduler-steps`; the server's `GET /stats` shows what its engine runs with, and a streamed
    answer through the gateway comes three tokens to a chunk (one chunk an engine step, as vLLM streams)."""
    import openai

    args = ["--model", "tiny:qwen2-mini", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "48"]
    args += ["--enforce-eager", "--num-scheduler-steps", "3"]
    proc, base, lines = _start_serve([*args, "--log-dir", str(tmp_path)], 120)
    try:
        server = httpx.get(f"{base}/health").json()["servers"][0]["url"]
        stats = httpx.get(f"{server}/stats", timeout=30).json()
        assert stats["enable_chunked_prefill"] is False and stats["max_num_batched_tokens"] == 48
        assert stats["enable_prefix_caching"] is True and stats["compile_decode"] is False
        assert stats["num_scheduler_steps"] == 3
        client = openai.OpenAI(base_url=f"{base}/sessions/steps/v1", api_key="none")
        chunks = client.chat.completions.create(
            model="tiny:qwen2-mini",
            messages=[{"role": "user", "content": "Count on."}],
            max_tokens=13,
            logprobs=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        sizes = [len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs]
        assert sum(sizes) == 13 and max(sizes) == 3 and sizes.count(3) >= 3, sizes
    finally:
        _interrupt(proc)
    assert proc.returncode == 0


def test_serve_vision_language_answers_an_openai_client_with_a_png(tmp_path: Path) -> None:
    """An official `openai` client sends a base64 PNG `image_url` part; the trace holds every image pad."""
    import openai
    from PIL import Image, ImageDraw

    from agentrl.data.images import encode_data_url
    from agentrl.models import load_causal_lm

    image = Image.new("RGB", (100, 60), "white")
    ImageDraw.Draw(image).ellipse((10, 10, 40, 40), fill="red")
    proc, base, lines = _start_serve(["--model", "tiny:qwen2-vl", "--max-tokens", "5"], 120)
    try:
        client = openai.OpenAI(base_url=f"{base}/sessions/vl/v1", api_key="none")
        content = [
            {"type": "image_url", "image_url": {"url": encode_data_url(image)}},
            {"type": "text", "text": "How many shapes?"},
        ]
        reply = client.chat.completions.create(
            model="tiny:qwen2-vl", messages=[{"role": "user", "content": content}]
        )
        assert reply.choices[0].message.role == "assistant"
        [trace] = httpx.get(f"{base}/sessions/vl/traces", headers=_admin(lines)).json()
        image_pad = load_causal_lm("tiny:qwen2-vl").config.image_token_id
        # 100x60 -> 112x56 pixels -> a 4x8 patch grid -> 8 tokens after the 2x2 merge.
        assert trace["prompt_ids"].count(image_pad) == 8
        assert len(trace["images"]) == 1 and trace["images"][0].startswith("data:image/png;base64,")
        assert len(trace["logprobs"]) == len(trace["response_ids"]) >= 1
        with pytest.raises(openai.BadRequestError, match="remote image URL"):
            client.chat.completions.create(
                model="tiny:qwen2-vl",
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
                    }
                ],
            )
    finally:
        out = _interrupt(proc)
    assert proc.returncode == 0, out


def test_serve_off_loopback_takes_the_users_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTRL_ADMIN_TOKEN", "users-own-token")
    token_file = tmp_path / "token"
    proc, base, lines = _start_serve(
        ["--model", "tiny:qwen2-mini", "--host", "0.0.0.0", "--max-tokens", "3",
         "--admin-token-file", str(token_file)], 120,
    )  # fmt: skip
    try:
        assert _token_file(lines) == token_file and token_file.read_text() == "users-own-token"
        local = base.replace("0.0.0.0", "127.0.0.1")
        chat = {"model": "tiny:qwen2-mini", "messages": [{"role": "user", "content": "hi"}]}
        assert (
            httpx.post(f"{local}/sessions/demo/v1/chat/completions", json=chat, timeout=60).status_code == 200
        )
        assert httpx.get(f"{local}/sessions/demo/traces").status_code == 401
        wrong = httpx.get(f"{local}/sessions/demo/traces", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403
        traces = httpx.get(
            f"{local}/sessions/demo/traces", headers={"Authorization": "Bearer users-own-token"}
        )
        assert traces.status_code == 200 and len(traces.json()) == 1
    finally:
        out = _interrupt(proc)
    assert proc.returncode == 0, out


@pytest.mark.vllm
def test_serve_vllm_sigint_leaves_no_process(tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build the vLLM environment with `make setup-vllm`")
    args = ["--model", "tiny:qwen2", "--engine", "vllm", "--servers", "1", "--max-tokens", "4",
            "--log-dir", str(tmp_path)]  # fmt: skip
    proc, base, _ = _start_serve(args, 300)
    try:
        port = re.search(r":(\d+)$", httpx.get(f"{base}/health").json()["servers"][0]["url"])[1]
        r = httpx.post(f"{base}/sessions/s/v1/completions", json={"prompt": "hello"}, timeout=60)
        assert r.status_code == 200, r.text
        # The log is named by the serving port (a launch in bfloat16 whose first generation crashed on this CPU
        # leaves its own log beside it: dtype auto relaunches in float32 on another port).
        assert (tmp_path / f"vllm_{port}.log").is_file(), sorted(p.name for p in tmp_path.glob("vllm_*.log"))
        vllm_pgids = _pgids_with_cmdline("vllm.entrypoints.openai.api_server", f"--port {port} ")
        assert vllm_pgids, "the vLLM server process was not found"
    finally:
        out = _interrupt(proc)
    assert proc.returncode == 0, out
    for pgid in vllm_pgids:
        assert not group_alive(pgid), f"vLLM process group {pgid} survived Ctrl-C"


def _pgids_with_cmdline(*needles: str) -> set[int]:
    """Process groups of processes whose command line contains every needle."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if all(n in cmd for n in needles):
                    found.add(os.getpgid(int(entry)))
            except (OSError, ProcessLookupError):
                continue
    return found
