"""RolloutPool: routes a session's requests to inference servers and keeps them in sync.

Routing is sticky least-loaded: a session's first request goes to the healthy server with the
fewest requests in flight (ties: fewest sessions, then list order) and the session stays there,
so multi-turn prompts hit that server's prefix cache. A request that fails at the transport level,
times out, or gets a 5xx marks its server unhealthy and is retried on another server (at most
`max_retries` times); the session moves with it. Unhealthy servers are probed (`GET /health`) again
after `probe_interval` seconds and rejoin when they answer; one that missed a weight update is
brought up to date first, so no request is ever served by stale weights. A 5xx whose body says the
engine died (vLLM's `EngineDeadError`: "EngineCore encountered an issue") marks the server unhealthy
with `engine died: ...` as its reason, kept in `last_error` while its health checks fail; a server
object with a `.process` (`VLLMServer`) whose process exited is reported unhealthy with its exit code.

Both engines sit behind the same pool; only their admin routes differ:

| operation         | embedded server                 | vLLM server (dev mode routes)                                        |
| ----------------- | ------------------------------- | -------------------------------------------------------------------- |
| full weights      | POST /update_weights {path}     | POST /collective_rpc reload_weights(weights_path); /reset_prefix_cache |
| LoRA adapter      | POST /v1/load_lora_adapter      | POST /v1/load_lora_adapter (load_inplace when the name is reused)     |
| sleep / wake up   | POST /sleep, POST /wake_up      | POST /sleep?level=1, POST /wake_up                                   |

Admin calls carry the servers' bearer token (`admin_auth.py`: by default this process's, which the servers it
serves require too). A server whose app
runs in this process (`uvicorn_thread.find_local_app`) is called in-process through
`httpx.ASGITransport`: same routes and answers, no TCP hop and no second event loop. Its generation
routes are called as Python (`app.DirectCalls`): the same answer as a dict, without the ASGI hop and
the JSON of every token's logprob entry; streamed ones too (`forward_stream`), their events as dicts as they
are generated (`httpx.ASGITransport` would hold a stream back until it is complete). Streams fail over until
their first event.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx

from agentrl.rollout._openai_protocol import build_error
from agentrl.rollout.admin_auth import admin_headers, resolve_admin_token
from agentrl.rollout.engines.vllm import describe_exit, engine_dead_reason
from agentrl.rollout.http_transport import ShardedHTTPTransport
from agentrl.rollout.pool_stream import PoolStream
from agentrl.rollout.uvicorn_thread import InProcessFirstTransport, find_local_app

log = logging.getLogger(__name__)

ENGINES = ("embedded", "vllm")


@dataclass
class ServerState:
    """What the pool knows about one server."""

    url: str
    engine: str = "embedded"
    healthy: bool = True
    in_flight: int = 0
    sessions: int = 0
    policy_version: int = 0
    last_error: str = ""
    next_probe_at: float = 0.0
    requests: int = 0
    failures: int = 0
    engine_dead: str = ""
    """Why its engine died (a 5xx naming vLLM's EngineDeadError, or its process exited); '' otherwise."""
    process: Any = field(default=None, repr=False, compare=False)
    """The server's process (`VLLMServer.process`) when the pool was given one: its exit is seen at once."""


class PoolResponse(NamedTuple):
    """A server's answer: HTTP status, parsed JSON body, which server answered, its policy version."""

    status: int
    body: Any
    server: str
    policy_version: int


class NoHealthyServerError(RuntimeError):
    """Every server is unhealthy (and none answered a fresh probe)."""


@dataclass
class _AdminState:
    """What a server that missed updates must replay before it serves again."""

    weights_path: str | None = None
    adapters: dict[str, str] = field(default_factory=dict)


class RolloutPool:
    """Sticky least-loaded routing, health tracking with failover, and admin broadcast."""

    def __init__(
        self,
        servers: Sequence[Any],
        *,
        model_name: str,
        engine: str = "embedded",
        request_timeout: float = 120.0,
        max_retries: int = 2,
        probe_interval: float = 2.0,
        probe_timeout: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
        admin_token: str | None = None,
        in_process: bool = True,
        direct: bool = True,
    ) -> None:
        """`servers`: URLs, or objects with `.url` (and optionally `.engine`, e.g. `VLLMServer`).

        `model_name` is the name the servers serve; requests are forwarded with `model` set to it
        (or to the active LoRA adapter). `transport` replaces httpx's network transport (tests serve
        several in-process apps through one). `admin_token` is sent with admin calls (default: this process's
        token, `admin_auth.process_admin_token`). `in_process`
        calls servers of this process in-process (see the module docstring); `direct=False` keeps their generation
        routes on ASGI too (benchmarks/rollout_overhead.py compares).
        """
        if not servers:
            raise ValueError("RolloutPool needs at least one server")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {list(ENGINES)}, got {engine!r}")
        self.servers = [_to_state(s, engine) for s in servers]
        self.model_name = model_name
        self.served_model = model_name
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.policy_version = 0
        self._sticky: dict[str, ServerState] = {}
        self._admin = _AdminState()
        self._probes: set[asyncio.Task] = set()
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[bool, httpx.AsyncClient]] = (
            weakref.WeakKeyDictionary()
        )
        self._transport = transport
        self._admin_token = resolve_admin_token(admin_token)
        self._in_process = in_process
        self._direct = direct

    # ---- routing -------------------------------------------------------------------------------

    def pick_server(self, session_id: str, exclude: Sequence[ServerState] = ()) -> ServerState:
        """The session's server: its sticky one if usable, else the least-loaded usable one."""
        usable = [s for s in self.servers if self._usable(s) and s not in exclude]
        if not usable:
            raise NoHealthyServerError(self._describe_unhealthy())
        current = self._sticky.get(session_id)
        if current in usable:
            return current
        best = min(usable, key=lambda s: (s.in_flight, s.sessions, self.servers.index(s)))
        self._assign(session_id, best)
        return best

    def forget_session(self, session_id: str) -> None:
        """Drop the session's stickiness (call when the session closes)."""
        state = self._sticky.pop(session_id, None)
        if state is not None:
            state.sessions -= 1

    def server_of(self, session_id: str) -> str | None:
        state = self._sticky.get(session_id)
        return state.url if state else None

    def mark_unhealthy(self, state: ServerState, reason: str) -> None:
        """Take the server out of routing; it is probed again after `probe_interval` seconds."""
        state.healthy = False
        state.failures += 1
        state.last_error = reason
        state.next_probe_at = time.monotonic() + self.probe_interval

    def mark_engine_dead(self, state: ServerState, reason: str) -> None:
        """Take the server out of routing because its engine died; `reason` stays in `last_error` (after
        each failed health check's own reason) until the server answers `GET /health` again."""
        if not state.engine_dead:
            log.warning("inference server %s is unhealthy: %s", state.url, reason)
        self.mark_unhealthy(state, reason)
        state.engine_dead = reason

    def check_processes(self) -> None:
        """Mark unhealthy, at once, every server whose process (when the pool knows it) has exited."""
        for state in self.servers:
            code = state.process.poll() if state.process is not None else None
            if code is not None and "server process exited" not in state.engine_dead:
                exited = f"server process exited ({describe_exit(code)})"
                self.mark_engine_dead(
                    state, f"{state.engine_dead}; {exited}" if state.engine_dead else exited
                )

    def server_health(self) -> list[dict[str, Any]]:
        """Per-server state for a health route: url, healthy, in_flight, policy_version and error (why it
        is unhealthy: its last error, e.g. `engine died: ...`; '' while healthy)."""
        self.check_processes()
        return [
            {
                "url": s.url,
                "healthy": s.healthy,
                "in_flight": s.in_flight,
                "policy_version": s.policy_version,
                "error": "" if s.healthy else s.last_error,
            }
            for s in self.servers
        ]

    def _usable(self, state: ServerState) -> bool:
        return state.healthy and state.policy_version == self.policy_version

    def _assign(self, session_id: str, state: ServerState) -> None:
        self.forget_session(session_id)
        self._sticky[session_id] = state
        state.sessions += 1

    def _describe_unhealthy(self) -> str:
        parts = [f"{s.url}: {s.last_error or 'stale weights'}" for s in self.servers]
        return "no healthy inference server; " + "; ".join(parts)

    # ---- requests ------------------------------------------------------------------------------

    async def forward(self, session_id: str, path: str, json_body: dict[str, Any]) -> PoolResponse:
        """POST `json_body` to `path` on the session's server, failing over on dead or hung servers.

        Returns the first non-5xx answer (4xx included: those are the client's fault and would fail
        anywhere). After `max_retries` failovers, or with no healthy server, returns a 503 whose
        body says what went wrong on each server.
        """
        return await self._route(session_id, lambda state: self._post(state, path, json_body))

    async def forward_stream(
        self, session_id: str, path: str, json_body: dict[str, Any]
    ) -> PoolResponse | PoolStream:
        """`forward` for a `stream: true` body: routed and failed over the same way until the server's first
        event arrives, then a `PoolStream` of its events (no failover after that byte). A JSON answer (a 4xx,
        the 503 of no healthy server) comes back as a `PoolResponse`, exactly as `forward` returns it.

        A server of this process streams as Python (`DirectCalls.stream`), others over HTTP.
        """
        return await self._route(session_id, lambda state: self._open_stream(state, path, json_body))

    async def _route(self, session_id: str, attempt: Any) -> Any:
        """Call `attempt(state)` -> (status, body) or an open `PoolStream` on the session's server, moving to
        another on a transport error, a timeout or a 5xx, at most `max_retries` times."""
        self.check_processes()
        self._schedule_due_probes()
        tried: list[ServerState] = []
        errors: list[str] = []
        for _ in range(self.max_retries + 1):
            try:
                state = self.pick_server(session_id, exclude=tried)
            except NoHealthyServerError:
                if not await self._probe_all_now(exclude=tried):
                    break
                continue
            tried.append(state)
            state.in_flight += 1
            state.requests += 1
            answer: Any = None
            try:
                # asyncio's timeout too: httpx's does not apply to an in-process server.
                async with asyncio.timeout(self.request_timeout):
                    answer = await attempt(state)
            except (httpx.HTTPError, ValueError, TimeoutError) as e:
                reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                self.mark_unhealthy(state, reason)
                errors.append(f"{state.url}: {reason}")
                continue
            finally:
                if not isinstance(answer, PoolStream):  # an open stream gives its slot back when it closes
                    state.in_flight -= 1
            if isinstance(answer, PoolStream):
                return answer
            status, body = answer
            if status >= 500:
                errors.append(f"{state.url}: {self.mark_server_error(state, status, body)}")
                continue
            return PoolResponse(status, body, state.url, state.policy_version)
        message = "request failed on every server tried: " + ("; ".join(errors) or self._describe_unhealthy())
        return PoolResponse(503, build_error(message, None, 503), "", -1)

    def mark_server_error(self, state: ServerState, status: int, body: Any) -> str:
        """Take a server that answered a 5xx out of routing (as engine-dead when the body says its engine
        died); returns the reason recorded."""
        dead = engine_dead_reason(_error_message(body))
        if dead is not None:
            reason = f"engine died: HTTP {status}: {dead}"
            self.mark_engine_dead(state, reason)
        else:
            reason = f"HTTP {status}: {str(body)[:300]}"
            self.mark_unhealthy(state, reason)
        return reason

    def _generation_headers(self, state: ServerState) -> dict[str, str]:
        """vLLM guards its /v1 routes with the run's token (`VLLM_API_KEY`, set at launch); agentrl's own
        servers want it on admin routes only."""
        return admin_headers(self._admin_token) if state.engine == "vllm" else {}

    async def _post(self, state: ServerState, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        answer = await self._call_direct(state.url, path, body)
        if answer is None:
            resp = await self._client().post(
                state.url + path,
                json=body,
                headers=self._generation_headers(state),
                timeout=self.request_timeout,
            )
            answer = resp.status_code, resp.json()
        return answer

    async def _open_stream(
        self, state: ServerState, path: str, body: dict[str, Any]
    ) -> tuple[int, Any] | PoolStream:
        direct = self._direct_server(state.url)
        answer = await self._open_direct_stream(direct, state, path, body) if direct is not None else None
        if answer is not None:
            return answer
        client = self._client(network=True)
        request = client.build_request(
            "POST",
            state.url + path,
            json=body,
            headers=self._generation_headers(state),
            timeout=self.request_timeout,
        )
        response = await client.send(request, stream=True)
        try:
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                await response.aread()
                return response.status_code, response.json()
            stream = PoolStream.over_http(self, state, response)
            await stream.peek()  # a server that drops before its first event fails over like any other
        except BaseException:
            await response.aclose()
            raise
        return stream

    async def _open_direct_stream(
        self, direct: Any, state: ServerState, path: str, body: dict[str, Any]
    ) -> tuple[int, Any] | PoolStream | None:
        """A stream of an embedded server of this process, its events as Python dicts (`DirectCalls.stream`);
        None for a path it does not serve as Python (the caller goes over HTTP)."""
        try:
            answer = await direct.stream(path, body)
        except Exception as error:  # noqa: BLE001 - over HTTP it is a 500 as well
            return self._direct_failure(state.url, path, error)
        if answer is None or isinstance(answer, tuple):
            return answer
        stream = PoolStream(self, state, answer, answer.aclose)
        try:
            await stream.peek()
        except BaseException:
            await answer.aclose()
            raise
        return stream

    def _direct_server(self, url: str) -> Any:
        """The `DirectCalls` of an embedded server this process serves at `url`, or None (call it over HTTP)."""
        app = find_local_app(url) if self._in_process and self._direct and self._transport is None else None
        return getattr(getattr(app, "state", None), "direct", None)

    async def _call_direct(self, url: str, path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        """The answer of an embedded server this process serves, called as Python (`server.DirectCalls`: no
        ASGI hop, no JSON); None when `url` is not one (or the request streams). An exception becomes the 500
        it would be over HTTP, so failover treats both paths alike."""
        direct = self._direct_server(url)
        if direct is None:
            return None
        try:
            return await direct.call(path, body)
        except Exception as error:  # noqa: BLE001 - the HTTP path turns it into a 500 as well
            return self._direct_failure(url, path, error)

    @staticmethod
    def _direct_failure(url: str, path: str, error: Exception) -> tuple[int, dict[str, Any]]:
        log.exception("in-process server %s failed on %s", url, path)
        return 500, {"error": {"message": f"{type(error).__name__}: {error}", "type": "InternalServerError"}}

    def _client(self, network: bool = False) -> httpx.AsyncClient:
        """One client per event loop: the gateway's loop forwards while the trainer's loop may
        broadcast weight updates from another thread at the same time. `network`: the one that never takes
        the in-process shortcut (streams)."""
        loop = asyncio.get_running_loop()
        for stale in [other for other in self._clients if other.is_closed()]:
            self._clients.pop(stale)  # a finished `asyncio.run` (a training step's collection)
        clients = self._clients.setdefault(loop, {})
        in_process = self._in_process and not network
        client = clients.get(in_process)
        if client is None:
            transport = self._transport
            if transport is None:

                def network() -> ShardedHTTPTransport:
                    return ShardedHTTPTransport(max_connections=1024, max_keepalive_connections=256)

                transport = InProcessFirstTransport(network) if in_process else network()
            client = httpx.AsyncClient(timeout=self.request_timeout, transport=transport)
            clients[in_process] = client
        return client

    async def aclose(self) -> None:
        """Close this loop's HTTP clients and cancel pending probes."""
        for task in list(self._probes):
            task.cancel()
        for client in self._clients.pop(asyncio.get_running_loop(), {}).values():
            await client.aclose()

    # ---- health --------------------------------------------------------------------------------

    async def probe(self, state: ServerState) -> bool:
        """GET /health; on success bring the server's weights up to date and mark it healthy.

        A server whose engine died keeps that reason in `last_error` while its checks fail."""
        code = state.process.poll() if state.process is not None else None
        if code is not None:  # no server will answer on its port: say why
            ok, reason = False, f"server process exited ({describe_exit(code)})"
        else:
            try:
                resp = await self._client().get(state.url + "/health", timeout=self.probe_timeout)
                ok = resp.status_code == 200
                reason = f"health check answered HTTP {resp.status_code}"
            except httpx.HTTPError as e:
                ok, reason = False, f"health check failed: {type(e).__name__}"
        if ok and state.policy_version != self.policy_version:
            ok, reason = await self._resync(state)
        if ok:
            state.healthy, state.last_error, state.engine_dead = True, "", ""
        else:
            if state.engine_dead:  # keep why the engine died in front of what this check saw
                reason = (
                    state.engine_dead if reason in state.engine_dead else f"{state.engine_dead}; {reason}"
                )
            state.healthy, state.last_error = False, reason
            state.next_probe_at = time.monotonic() + self.probe_interval
        return ok

    async def probe_unhealthy(self) -> list[str]:
        """Probe every unhealthy server now; returns the URLs that came back."""
        down = [s for s in self.servers if not self._usable(s)]
        results = await asyncio.gather(*(self.probe(s) for s in down))
        return [s.url for s, ok in zip(down, results, strict=True) if ok]

    async def _probe_all_now(self, exclude: Sequence[ServerState]) -> bool:
        candidates = [s for s in self.servers if not self._usable(s) and s not in exclude]
        results = await asyncio.gather(*(self.probe(s) for s in candidates))
        return any(results)

    def _schedule_due_probes(self) -> None:
        now = time.monotonic()
        for state in self.servers:
            if not self._usable(state) and state.next_probe_at <= now:
                state.next_probe_at = now + self.probe_interval  # one probe in flight at a time
                task = asyncio.get_running_loop().create_task(self.probe(state))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    # ---- admin broadcast -----------------------------------------------------------------------

    async def update_weights(self, weights_path: str, *, version: int | None = None) -> int:
        """Load full weights from the HF folder `weights_path` on every server; returns the version.

        For vLLM the folder's safetensors must hold every parameter under its HF name, including
        `lm_head.weight` for tied-embedding models (see `agentrl.rollout.engines.vllm.save_weights_for_vllm`).
        A server that fails is marked unhealthy and replays this update when it comes back.
        """
        new_version = self.policy_version + 1 if version is None else version
        self._admin.weights_path = weights_path
        await self._broadcast(new_version, self._apply_weights, weights_path, new_version)
        return self.policy_version

    async def load_lora_adapter(self, name: str, path: str, *, activate: bool = True) -> int:
        """Load (or replace) LoRA adapter `name` from `path` on every server.

        With `activate`, requests are served by this adapter from now on and the policy version goes up.
        """
        replace = name in self._admin.adapters
        self._admin.adapters[name] = path
        new_version = self.policy_version + 1 if activate else self.policy_version
        await self._broadcast(new_version, self._apply_adapter, name, path, replace)
        if activate:
            self.served_model = name
        return self.policy_version

    async def sleep(self) -> None:
        """Ask every healthy server to free its generation memory (vLLM on CPU logs and ignores it)."""
        await self._broadcast_admin(lambda s: ("/sleep?level=1" if s.engine == "vllm" else "/sleep", {}))

    async def wake_up(self) -> None:
        await self._broadcast_admin(lambda s: ("/wake_up", {}))

    async def _broadcast(self, new_version: int, apply: Any, *args: Any) -> None:
        """Apply an update to every healthy server, then move the pool to `new_version`.

        Servers keep serving at the old version until the broadcast ends; one that failed stays
        behind, so routing skips it until a probe has replayed the update on it.
        """

        async def one(state: ServerState) -> None:
            ok, reason = await apply(state, *args)
            if ok:
                state.policy_version = new_version
            else:
                self.mark_unhealthy(state, reason)

        await asyncio.gather(*(one(s) for s in self.servers if self._usable(s)))
        self.policy_version = new_version
        if not any(self._usable(s) for s in self.servers):
            raise NoHealthyServerError("update failed on every server: " + self._describe_unhealthy())

    async def _broadcast_admin(self, route: Any) -> None:
        async def one(state: ServerState) -> None:
            path, body = route(state)
            ok, reason = await self._post_admin(state, path, body)
            if not ok:
                self.mark_unhealthy(state, reason)

        await asyncio.gather(*(one(s) for s in self.servers if s.healthy))

    async def _apply_weights(self, state: ServerState, weights_path: str, version: int) -> tuple[bool, str]:
        if state.engine == "vllm":
            body = {"method": "reload_weights", "kwargs": {"weights_path": weights_path}}
            ok, reason = await self._post_admin(state, "/collective_rpc", body)
            if ok:  # KV blocks computed with the old weights must not be reused
                ok, reason = await self._post_admin(state, "/reset_prefix_cache", {})
            return ok, reason
        return await self._post_admin(
            state, "/update_weights", {"path": weights_path, "policy_version": version}
        )

    async def _apply_adapter(
        self, state: ServerState, name: str, path: str, replace: bool
    ) -> tuple[bool, str]:
        body: dict[str, Any] = {"lora_name": name, "lora_path": path}
        if replace and state.engine == "vllm":
            body["load_inplace"] = True
        return await self._post_admin(state, "/v1/load_lora_adapter", body)

    async def _resync(self, state: ServerState) -> tuple[bool, str]:
        """Replay the last full-weight update and every adapter on a server that missed them."""
        if self._admin.weights_path is not None:
            ok, reason = await self._apply_weights(state, self._admin.weights_path, self.policy_version)
            if not ok:
                return False, f"weight resync failed: {reason}"
        for name, path in self._admin.adapters.items():
            ok, reason = await self._apply_adapter(state, name, path, True)
            if not ok:
                return False, f"adapter {name!r} resync failed: {reason}"
        state.policy_version = self.policy_version
        return True, ""

    async def _post_admin(self, state: ServerState, path: str, body: dict[str, Any]) -> tuple[bool, str]:
        try:
            resp = await self._client().post(
                state.url + path,
                json=body,
                headers=admin_headers(self._admin_token),
                timeout=max(self.request_timeout, 300.0),
            )
        except httpx.HTTPError as e:
            return False, f"POST {path}: {type(e).__name__}: {e}"
        if resp.status_code != 200:
            return False, f"POST {path}: HTTP {resp.status_code}: {resp.text[:300]}"
        return True, ""


def _to_state(server: Any, default_engine: str) -> ServerState:
    if isinstance(server, str):
        return ServerState(url=server.rstrip("/"), engine=default_engine)
    process = getattr(server, "process", None)
    return ServerState(
        url=server.url.rstrip("/"),
        engine=getattr(server, "engine", default_engine),
        process=process if callable(getattr(process, "poll", None)) else None,
    )


def _error_message(body: Any) -> str:
    """An error answer's `error.message` (OpenAI's shape, vLLM's too), else the whole body as text."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body))
    return str(body)
