"""Flows in worker processes (`agent.num_workers`): the agents' own Python off the trainer's process.

With the local backend one Python process runs the flows, their `openai` clients, the gateway, the embedded
server and the engine's scheduler thread, all under one GIL. In the 8-turn agent benchmark on an H200
(`benchmarks/agent_step.py`, 128 episodes) the main thread held the GIL for ~80% of generation, 37% of that in
the `openai` client's own request building and parsing, and the engine thread, which needs the GIL between
decode steps, took 6-8 ms a step for ~2 ms of device work (docs/benchmarks.md). verl runs its agent loops in
worker processes for the same reason (`actor_rollout_ref.rollout.agent.num_workers`).

A pool of `python -m agentrl.rollout.flow_worker` processes, started once and kept for the run. Each rollout
goes to the worker with the fewest in flight, as its flow (pickled with cloudpickle once per worker, so a
flow defined in a script's `__main__` travels too), task and gateway session; the worker runs it on its own
event loop with an `openai` client over loopback TCP and sends back the result or how it failed. The traces,
the evaluator and everything else stay in the trainer. A worker holds a copy of the flow: state the flow
keeps between rollouts stays in that worker. A worker that dies fails its rollouts in flight (retryable: the
collector tries them again within `agent.retry_limit`) and is started again for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any

import cloudpickle

from agentrl.rollout.flow_job import KEY_ENV, FlowCall, FlowFailed, FlowSession
from agentrl.types import TerminationReason

CONNECT_TIMEOUT_S = 60.0
"""How long a new worker may take to import and connect back."""


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen
    conn: Connection
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    flows: set[int] = field(default_factory=set)
    alive: bool = True

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)


class FlowWorkerPool:
    """`size` flow worker processes; `run` a rollout in one of them, `close` them all."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"agent.num_workers={size}: a pool needs at least one worker")
        self._key = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._key)
        self._lock = threading.Lock()
        self._jobs = 0
        self._flows: dict[int, tuple[Any, bytes]] = {}  # id(flow) -> (the flow, kept alive; its pickle)
        self._workers = self._start(list(range(size)))

    def pids(self) -> list[int]:
        return [worker.process.pid for worker in self._workers]

    def _start(self, indices: list[int]) -> list[_Worker]:
        """Start workers `indices` together (each imports for ~1 s) and wait until every one has connected."""
        host, port = self._listener.address
        env = {**os.environ, KEY_ENV: self._key.hex()}
        processes = {
            index: subprocess.Popen(
                [sys.executable, "-m", "agentrl.rollout.flow_worker", host, str(port), str(index)], env=env
            )
            for index in indices
        }
        connected: dict[int, Connection] = {}

        def accept() -> None:
            while len(connected) < len(indices):
                conn = self._listener.accept()
                connected[conn.recv()] = conn  # a worker says its index first

        waiter = threading.Thread(target=accept, name="flow-worker-accept", daemon=True)
        waiter.start()
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while waiter.is_alive() and time.monotonic() < deadline:
            if any(p.poll() is not None for i, p in processes.items() if i not in connected):
                break
            waiter.join(timeout=0.05)
        missing = [i for i in indices if i not in connected]
        if missing:
            for process in processes.values():
                process.kill()
            self._listener.close()  # the waiting accept ends with it; later workers get a new listener
            self._listener = Listener(("127.0.0.1", 0), authkey=self._key)
            codes = {i: processes[i].wait() for i in missing}
            raise RuntimeError(
                f"flow workers {missing} did not connect (exit codes {codes}; {CONNECT_TIMEOUT_S:.0f} s allowed): "
                "see their output above; agent.num_workers=0 runs the flows in the trainer's process"
            )
        workers = []
        for index in indices:
            worker = _Worker(index, processes[index], connected[index])
            worker.send(("setup", list(sys.path)))
            threading.Thread(
                target=self._read, args=(worker,), name=f"flow-worker-{index}", daemon=True
            ).start()
            workers.append(worker)
        return workers

    async def run(self, call: FlowCall, session: FlowSession) -> Any:
        """The result of `call` in `session`, run by a worker; raises `FlowFailed` as the worker classified a
        flow that raised. Cancelled (`agent.timeout`), it cancels the rollout in the worker."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            worker = self._least_loaded()
            self._jobs += 1
            job = self._jobs
            worker.pending[job] = future
        key = id(call.flow)
        try:
            if key not in worker.flows:
                worker.send(("flow", key, self._pickled(call.flow)))
                worker.flows.add(key)
            worker.send(("run", job, key, cloudpickle.dumps((call.task, call.n)), session))
        except OSError as exc:  # it died since it was chosen: its reader marks it, the next run restarts it
            worker.pending.pop(job, None)
            raise FlowFailed(
                TerminationReason.ERROR, f"flow worker {worker.index} is gone: {exc!r}", retryable=True
            ) from exc
        except BaseException:
            worker.pending.pop(job, None)
            raise
        try:
            return await future
        except asyncio.CancelledError:
            if worker.pending.pop(job, None) is not None and worker.alive:
                with contextlib.suppress(OSError):  # a worker that just died has nothing to cancel
                    worker.send(("cancel", job))
            raise

    def _least_loaded(self) -> _Worker:
        """The live worker with the fewest rollouts in flight; a dead one is started again first."""
        dead = [worker.index for worker in self._workers if not worker.alive]
        if dead:
            started = {worker.index: worker for worker in self._start(dead)}
            self._workers = [started.get(worker.index, worker) for worker in self._workers]
        return min(self._workers, key=lambda w: len(w.pending))

    def _pickled(self, flow: Any) -> bytes:
        entry = self._flows.get(id(flow))
        if entry is None or entry[0] is not flow:
            try:
                entry = (flow, cloudpickle.dumps(flow))
            except Exception as exc:
                raise TypeError(
                    f"agent.num_workers: the flow {type(flow).__name__} cannot be pickled for a worker "
                    f"process ({exc}); set agent.num_workers=0 to run it in the trainer's process"
                ) from exc
            self._flows[id(flow)] = entry
        return entry[1]

    def _read(self, worker: _Worker) -> None:
        """The worker's answers, each to its rollout's future; when the worker is gone, its rollouts fail."""
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = worker.pending.pop(message[1], None)
            if future is not None:
                future.get_loop().call_soon_threadsafe(_settle, future, message)
        with self._lock:
            worker.alive = False
            lost, worker.pending = worker.pending, {}
        code = worker.process.wait()
        for future in lost.values():
            failed = FlowFailed(
                TerminationReason.ERROR,
                f"flow worker {worker.index} (pid {worker.process.pid}) exited with code {code} during the rollout",
                retryable=True,
            )
            future.get_loop().call_soon_threadsafe(_fail, future, failed)

    def close(self) -> None:
        for worker in self._workers:
            if worker.alive:
                with contextlib.suppress(OSError):
                    worker.send(("stop",))
        for worker in self._workers:
            try:
                worker.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.conn.close()
        self._workers = []
        self._listener.close()


def _settle(future: asyncio.Future, message: tuple) -> None:
    if future.done():
        return
    if message[0] == "done":
        try:
            future.set_result(cloudpickle.loads(message[2]))
        except Exception as exc:  # noqa: BLE001 - a result this process cannot rebuild fails its rollout
            future.set_exception(
                FlowFailed(
                    TerminationReason.ERROR, f"the flow's result could not be unpickled: {exc!r}", False
                )
            )
    else:
        _, _, reason, error, retryable = message
        future.set_exception(FlowFailed(reason, error, retryable))


def _fail(future: asyncio.Future, failed: FlowFailed) -> None:
    if not future.done():
        future.set_exception(failed)
