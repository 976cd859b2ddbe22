"""A stand-in for `python -m vllm.entrypoints.openai.api_server` whose first generation can kill it.

It takes vLLM's command line (the launcher's flags; only --port, --served-model-name and --dtype matter),
answers `GET /health` at once, and answers `POST /v1/completions` with one token, unless the server's
`--dtype` is listed in `$FAKE_VLLM_CRASH_DTYPES` (comma-separated). Then the request kills it, the way
vLLM's bfloat16 CPU kernels die on some x86 hosts (`$FAKE_VLLM_CRASH_HOW`):

- `signal` (default): the server process dies with SIGILL mid-request (exit code -4), no answer sent;
- `engine-dead`: an "engine core" child process dies with SIGILL, the server answers vLLM's 500
  (`EngineDeadError`'s message) and then exits with code 1, as vLLM's API server does.

Standard library only, so it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", default="fake")
    parser.add_argument("--dtype", default="auto")
    args, _ = parser.parse_known_args(argv)
    crash = args.dtype in os.environ.get("FAKE_VLLM_CRASH_DTYPES", "").split(",")
    how = os.environ.get("FAKE_VLLM_CRASH_HOW", "signal")
    print(f"fake vLLM: port {args.port}, dtype {args.dtype}, crash {crash} ({how})", flush=True)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *a: object) -> None:
            print(fmt % a, flush=True)

        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._send(200 if self.path == "/health" else 404, {})

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/v1/completions":
                return self._send(404, {})
            if not crash:
                choice = {"index": 0, "text": "!", "finish_reason": "length"}
                return self._send(200, {"model": args.served_model_name, "choices": [choice]})
            if how == "signal":
                print("Illegal instruction (fake bfloat16 kernel)", flush=True)
                os.kill(os.getpid(), signal.SIGILL)  # Python leaves SIGILL's default action: die
            pid = os.fork()
            if pid == 0:  # the "engine core"
                os.kill(os.getpid(), signal.SIGILL)
            _, status = os.waitpid(pid, 0)
            print(
                f"Engine core proc EngineCore died unexpectedly (exit code: {-os.WTERMSIG(status)})",
                flush=True,
            )
            error = {"message": ENGINE_DEAD, "type": "InternalServerError", "param": None, "code": 500}
            self._send(500, {"error": error})
            threading.Timer(0.2, lambda: os._exit(1)).start()

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
