"""`agentrl serve`: N inference servers behind the gateway (127.0.0.1 unless `--host`), until Ctrl-C.

This is how a user tries an agent against the policy before training, and how tests drive the
rollout stack from outside: point any OpenAI client at `{base}/sessions/{id}/v1` (any id: sessions
open on first use here) and read `GET {base}/sessions/{id}/traces` for the exact tokens and logprobs.
Everything it starts (engine threads, vLLM process groups, the gateway) stops on Ctrl-C or SIGTERM.
The servers always listen on loopback; with `--host` off loopback, the gateway's session and trace
routes need a bearer token (`--admin-token`, `$AGENTRL_ADMIN_TOKEN`, or one made and printed at start).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
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
        help="bearer token for session/trace routes (default: $AGENTRL_ADMIN_TOKEN; made per run off loopback)",
    )
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256, help="cap on completion tokens per call")
    p.add_argument("--temperature", type=float, default=1.0, help="enforced sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 for embedded by default; auto for vLLM (bfloat16, float32 where bfloat16 crashes on CPU)",
    )
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    p.add_argument("--log-dir", default="outputs/serve_logs", help="vLLM server logs")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.servers < 1:
        p.error(f"--servers must be >= 1, got {args.servers}")
    return args


def _start_embedded(
    model: str, args: argparse.Namespace, name: str, cleanup: list[Callable[[], Any]]
) -> list[str]:
    from agentrl.rollout.app import build_server_app
    from agentrl.rollout.engines.embedded import build_embedded_engine
    from agentrl.rollout.uvicorn_thread import start_server_in_thread

    urls = []
    for _ in range(args.servers):
        engine = build_embedded_engine(model, dtype=args.dtype or "float32", max_model_len=args.max_model_len)
        cleanup.append(engine.close)
        app = build_server_app(engine, engine.tokenizer, model_name=name, max_model_len=args.max_model_len)
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
        max_model_len=args.max_model_len, dtype=args.dtype or "auto",
        startup_timeout=args.startup_timeout, log_dir=args.log_dir,
    )  # fmt: skip
    cleanup.append(servers.stop)
    return list(servers)


def main(argv: list[str] | None = None) -> int:
    """Start the servers and the gateway, print how to use them, block until Ctrl-C or SIGTERM."""
    from agentrl.models import resolve_model_path
    from agentrl.rollout.gateway import Gateway
    from agentrl.rollout.pool import RolloutPool

    args = _parse_args(list(sys.argv[1:] if argv is None else argv))
    stop = threading.Event()
    cleanup: list[Callable[[], Any]] = []
    name = args.served_model_name or args.model
    try:
        model = resolve_model_path(args.model)
        start = _start_vllm if args.engine == "vllm" else _start_embedded
        servers = start(model, args, name, cleanup)
        pool = RolloutPool(servers, model_name=name, engine=args.engine)
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
        gateway = Gateway(
            pool, sampling_train=sampling, allow_implicit_sessions=True, host=args.host, port=args.port,
            admin_token=args.admin_token,
        ).start()  # fmt: skip
        cleanup.append(gateway.stop)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        base = gateway.url
        print(
            f"agentrl serve: {args.servers} {args.engine} server(s) for {name} behind the gateway at {base}\n"
            f"  OpenAI base URL of session <id>:  {base}/sessions/<id>/v1   (model={name!r}; any id opens a session)\n"
            f"  traces of session <id>:           GET {base}/sessions/<id>/traces\n"
            f"  health:                           GET {base}/health\n"
            f"  Ctrl-C stops everything.",
            flush=True,
        )
        if gateway.admin_token:
            print(
                f"  admin token (traces, sessions):   Authorization: Bearer {gateway.admin_token}", flush=True
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
