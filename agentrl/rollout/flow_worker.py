"""A flow worker process (`agent.num_workers`): runs the trainer's rollouts on an event loop of its own.

`FlowWorkerPool` starts it as `python -m agentrl.rollout.flow_worker HOST PORT INDEX`, with the pool's key in
the environment; it connects back, says its index, and serves these messages until told to stop or the
trainer goes away:

- ("setup", sys.path): the trainer's import path, so flows pickled by reference unpickle here;
- ("flow", key, pickled flow): a flow later jobs name by `key`;
- ("run", job id, key, pickled (task, n), FlowSession): one rollout; it answers ("done", job id, pickled
  result) or ("failed", job id, reason, error, retryable), classified as the collector classifies a flow that
  raised in its own process (`collector.failure_of`);
- ("cancel", job id): the collector stopped waiting (`agent.timeout`): the rollout is cancelled;
- ("stop",).

Each rollout gets its own `openai.AsyncOpenAI` bound to its gateway session over loopback TCP, all sharing one
HTTP client, as in the trainer's process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from multiprocessing.connection import Client, Connection
from typing import Any

import cloudpickle
import httpx

from agentrl.rollout.collector import failure_of, run_flow
from agentrl.rollout.flow_client import flow_client, prime_platform
from agentrl.rollout.flow_job import KEY_ENV, FlowCall, FlowSession
from agentrl.rollout.http_transport import ShardedHTTPTransport

CONNECTIONS = 256
"""HTTP connections a worker keeps to the gateway (more rollouts than this at once queue for one)."""


def main(host: str, port: int, index: int) -> None:
    # Ctrl-C reaches the whole process group: the trainer stops its workers itself (or they see its
    # connection close), so a worker does not die mid-rollout with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Client((host, port), authkey=bytes.fromhex(os.environ.pop(KEY_ENV)))
    conn.send(index)
    prime_platform()
    asyncio.run(_serve(conn))


async def _serve(conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple] = asyncio.Queue()

    def read() -> None:  # blocking reads on a thread; the loop handles each message
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the trainer is gone
                message = ("stop",)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "stop":
                return

    threading.Thread(target=read, name="flow-worker-inbox", daemon=True).start()
    flows: dict[int, Any] = {}
    running: dict[int, asyncio.Task] = {}
    transport = ShardedHTTPTransport(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    async with httpx.AsyncClient(transport=transport) as http:
        while (message := await inbox.get())[0] != "stop":
            kind = message[0]
            if kind == "setup":
                sys.path[:0] = [p for p in message[1] if p not in sys.path]
            elif kind == "flow":
                flows[message[1]] = cloudpickle.loads(message[2])
            elif kind == "run":
                _, job, key, payload, session = message
                task, n = cloudpickle.loads(payload)
                call = FlowCall(flows[key], task, n)
                running[job] = asyncio.create_task(_rollout(conn, job, call, session, http, running))
            elif kind == "cancel" and (rollout := running.pop(message[1], None)) is not None:
                rollout.cancel()
        for rollout in running.values():
            rollout.cancel()


async def _rollout(
    conn: Connection,
    job: int,
    call: FlowCall,
    session: FlowSession,
    http: httpx.AsyncClient,
    running: dict[int, asyncio.Task],
) -> None:
    try:
        result = await run_flow(call, session.context(flow_client(session.base_url, session.timeout, http)))
        reply: tuple = ("done", job, cloudpickle.dumps(result))
    except asyncio.CancelledError:  # the collector gave up on it: nobody waits for an answer
        return
    except Exception as exc:  # noqa: BLE001 - a failing agent costs one rollout, not the worker
        reason, error, retryable = failure_of(exc)
        reply = ("failed", job, reason, error, retryable)
    finally:
        running.pop(job, None)
    conn.send(reply)  # from the loop's thread only


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
