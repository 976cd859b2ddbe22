"""`agentrl serve`: N inference servers behind the gateway (127.0.0.1 unless `--host`), until Ctrl-C.

This is how a user tries an agent against the policy before training, and how tests drive the
rollout stack from outside: point any OpenAI client at `{base}/sessions/{id}/v1` (any id: sessions
open on first use here) and read `GET {base}/sessions/{id}/traces` (with the admin token) for the exact tokens
and logprobs.
Everything it starts (engine threads, vLLM process groups, the gateway) stops on Ctrl-C or SIGTERM.
The servers always listen on loopback. Admin routes (the gateway's sessions and traces, the servers' weights
and sleep) need a bearer token on every bind: `--admin-token`, else `$AGENTRL_ADMIN_TOKEN`, else one made for
this run. It is written to a file of mode 0600 (`--admin-token-file`, removed at exit) whose path is printed.
Start-up errors (a port in use, a model that does not load) print one line and exit with status 2, like
`agentrl train`; the port is checked before any model loads.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.types import SamplingParams


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="agentrl serve", description="Serve a policy behind the agentrl gateway (OpenAI-compatible)."
    )
    p.add_argument("--model", required=True, help="HF folder, HF id, tiny:<preset> or smollm2-135m-instruct")
    p.add_argument("--engine", choices=["embedded", "vllm"], default="embedded")
    p.add_argument("--servers", type=int, default=1, help="number of inference servers (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="gateway port (default: a free one)")
    p.add_argument(
        "--admin-token",
        default=None,
        help="bearer token of the admin routes (default: $AGENTRL_ADMIN_TOKEN, else one made for this run)",
    )
    p.add_argument(
        "--admin-token-file",
        default=None,
        help="where the token is written, mode 0600 (default: <--log-dir>/admin_token_<gateway port>)",
    )
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="sequences the embedded engine decodes at once (vLLM's flag)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the keys and values of prompt prefixes computed before (vLLM's flag; on unless --no-...)",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="while rows decode, prefill at most --max-num-batched-tokens prompt tokens a step, a long prompt "
        "over several steps (vLLM's flag; on unless --no-...)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="prompt tokens one prefill forward (and, chunked, one step) computes (vLLM's flag; embedded: 8192)",
    )
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=None,
        help="embedded: decode steps per engine step for rows drawing on the device (vLLM V0's flag; default 1 "
        "on the CPU: a step is its compute)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="embedded: no torch.compile of the decode step and no CUDA graphs (vLLM's flag; both on by default)",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="cap on completion tokens per call")
    p.add_argument("--temperature", type=float, default=1.0, help="enforced sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 for embedded by default; auto for vLLM (bfloat16, float32 where bfloat16 crashes on CPU)",
    )
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the embedded engine (CPU); default: the cores this process may use",
    )
    p.add_argument("--log-dir", default="outputs/serve_logs", help="vLLM server logs")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.servers < 1:
        p.error(f"--servers must be >= 1, got {args.servers}")
    if args.max_num_seqs < 1:
        p.error(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 16:
        p.error(f"--max-num-batched-tokens must be >= 16, got {args.max_num_batched_tokens}")
    if args.num_scheduler_steps is not None:
        if args.num_scheduler_steps < 1:
            p.error(f"--num-scheduler-steps must be >= 1, got {args.num_scheduler_steps}")
        if args.engine == "vllm":
            p.error("--num-scheduler-steps is the embedded engine's (vLLM 0.32 schedules one step at a time)")
    return args


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The prefill and scheduling flags given, as the embedded engine's arguments (the rest keep its defaults)."""
    named = {
        "enable_prefix_caching": args.enable_prefix_caching,
        "chunked_prefill": args.enable_chunked_prefill,
        "prefill_chunk_tokens": args.max_num_batched_tokens,
        "num_scheduler_steps": args.num_scheduler_steps,
    }
    return {key: value for key, value in named.items() if value is not None}


def _vllm_prefill_flags(args: argparse.Namespace) -> list[str]:
    """The same flags for `vllm serve`, only those given (vLLM keeps its own defaults otherwise)."""
    flags = []
    for name in ("enable_prefix_caching", "enable_chunked_prefill"):
        value = getattr(args, name)
        if value is not None:
            flags.append(f"--{'' if value else 'no-'}{name.replace('_', '-')}")
    if args.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return flags


def _check_bind(host: str, port: int) -> str | None:
    """Why the gateway could not listen on `host:port` (one line naming the flag), or None: checked before any
    model loads, so a taken port costs no start-up time."""
    if port == 0:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return (
                    f"--port {port}: {host}:{port} is already in use; pick another --port, "
                    "or leave it out for a free one"
                )
            return f"--host {host} --port {port}: cannot listen there ({error.strerror or error})"
    return None


def engine_threads() -> int:
    """Torch threads for an embedded engine on the CPU: every core this process may use. On 2 cores, vLLM's
    serving benchmark (`benchmarks/serve_vs_vllm.py`, twentieth session, paired rounds) served 43.9-62.6
    requests/s with 2 threads against 34.2-52.1 with 1: the gateway's and the server's event loops take about a
    third of a core, and the engine's memory-bound attention gains more from the second core's bandwidth than it
    loses to them. (At b7a8983 the opposite held, 2.95 against 14.47 requests/s, with an engine that woke each
    request's loop per token; so the default left a core free until then.)"""
    return max(1, len(os.sched_getaffinity(0)))


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:500] or type(error).__name__


def _start_embedded(
    model: str, args: argparse.Namespace, name: str, token: str, cleanup: list[Callable[[], Any]]
) -> list[str]:
    import torch

    from agentrl.rollout.app import build_server_app
    from agentrl.rollout.engines.embedded import build_embedded_engine
    from agentrl.rollout.uvicorn_thread import start_server_in_thread

    # The engines' threads compute; this one loads on one torch thread, so that no second OpenMP pool outnumbers
    # the cores (`EmbeddedEngine`'s `threads`).
    torch.set_num_threads(1)
    urls = []
    for _ in range(args.servers):
        engine = build_embedded_engine(
            model,
            dtype=args.dtype or "float32",
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            cuda_graphs=not args.enforce_eager,
            compile_decode=not args.enforce_eager,
            threads=args.threads or engine_threads(),
            **_engine_options(args),
        )
        cleanup.append(engine.close)
        app = build_server_app(
            engine, engine.tokenizer, model_name=name, max_model_len=args.max_model_len, admin_token=token
        )
        handle = start_server_in_thread(app)
        cleanup.append(handle.stop)
        urls.append(handle.url)
    return urls


def _start_vllm(
    model: str, args: argparse.Namespace, name: str, cleanup: list[Callable[[], Any]]
) -> list[Any]:
    from agentrl.rollout.engines.vllm import launch_vllm_servers

    servers = launch_vllm_servers(
        model, args.servers, python=args.vllm_python, served_model_name=name,
        max_model_len=args.max_model_len, dtype=args.dtype or "auto", max_num_seqs=args.max_num_seqs,
        extra_args=[*_vllm_prefill_flags(args), *(["--enforce-eager"] if args.enforce_eager else [])],
        startup_timeout=args.startup_timeout, log_dir=args.log_dir,
    )  # fmt: skip
    cleanup.append(servers.stop)
    return list(servers)


def main(argv: list[str] | None = None) -> int:
    """Start the servers and the gateway, print how to use them, block until Ctrl-C or SIGTERM."""
    from agentrl.models import resolve_model_path
    from agentrl.models.loading import model_path_problem
    from agentrl.rollout.admin_auth import resolve_admin_token, write_token_file
    from agentrl.rollout.gateway import Gateway
    from agentrl.rollout.pool import RolloutPool

    args = _parse_args(list(sys.argv[1:] if argv is None else argv))
    if problem := model_path_problem(args.model, "--model") or _check_bind(args.host, args.port):
        print(f"agentrl serve: {problem}", file=sys.stderr)
        return 2
    stop = threading.Event()
    cleanup: list[Callable[[], Any]] = []
    name = args.served_model_name or args.model
    token = resolve_admin_token(args.admin_token)
    try:
        try:
            model = resolve_model_path(args.model)
            if args.engine == "vllm":
                servers = _start_vllm(model, args, name, cleanup)
            else:
                servers = _start_embedded(model, args, name, token, cleanup)
        except (OSError, ValueError) as error:
            print(f"agentrl serve: --model {args.model}: {_one_line(error)}", file=sys.stderr)
            return 2
        except RuntimeError as error:  # a server that did not come up (vLLM: its log is named)
            print(f"agentrl serve: {_one_line(error)}", file=sys.stderr)
            return 1
        pool = RolloutPool(servers, model_name=name, engine=args.engine, admin_token=token)
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
        try:
            gateway = Gateway(
                pool, sampling_train=sampling, allow_implicit_sessions=True, host=args.host, port=args.port,
                admin_token=token,
            ).start()  # fmt: skip
        except OSError as error:  # taken between the check and now
            print(f"agentrl serve: --port {args.port}: {_one_line(error)}", file=sys.stderr)
            return 2
        cleanup.append(gateway.stop)
        port = gateway.url.rsplit(":", 1)[1]
        token_file = write_token_file(
            args.admin_token_file or Path(args.log_dir) / f"admin_token_{port}", token
        )
        cleanup.append(lambda: token_file.unlink(missing_ok=True))
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        base = gateway.url
        metrics = "  ".join(f"GET {getattr(server, 'url', server)}/metrics" for server in servers)
        print(
            f"agentrl serve: {args.servers} {args.engine} server(s) for {name} behind the gateway at {base}\n"
            f"  OpenAI base URL of session <id>:  {base}/sessions/<id>/v1   (model={name!r}; any id opens a session)\n"
            f"  traces of session <id>:           GET {base}/sessions/<id>/traces   (an admin route)\n"
            f"  metrics of each server:           {metrics}   (Prometheus, vLLM's names)\n"
            f"  admin token file (mode 0600):     {token_file}   (send 'Authorization: Bearer <its text>')\n"
            f"  health:                           GET {base}/health\n"
            f"  Ctrl-C stops everything.",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
        print("agentrl serve: stopping", flush=True)
    except KeyboardInterrupt:
        print("agentrl serve: interrupted, stopping", flush=True)
    finally:
        for fn in reversed(cleanup):
            fn()
    return 0
