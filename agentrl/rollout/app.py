"""OpenAI-compatible HTTP server for the embedded engine (FastAPI), token-in/token-out.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health (status `ok`, or
`sleeping`), admin routes POST /update_weights, /v1/load_lora_adapter, /sleep, /wake_up (`server_admin.py`,
with the open GET /is_sleeping); GET /metrics (Prometheus text under vLLM's names, `prometheus.py`) and GET /stats (the
engine's counters as JSON).
Responses carry `policy_version` (the weights version when the request started) and, with
`return_token_ids: true`, the exact prompt and completion token ids in vLLM 0.32's fields. A stream asked with
`agentrl_final_body: true` (the gateway's) ends with the whole unstreamed body, built by the same code.
`tool_choice` naming a function or `"required"`, and `response_format` `json_schema` / `json_object`,
are served by constrained decoding (`engines/constraints.py`); the forced call comes back as `tool_calls`.
Bad requests get a 400 in OpenAI's error shape naming the field (`param`); a model name other than
the served one (or its LoRA adapter) is a 404 naming `model`, as vLLM answers. A vision-language
engine takes `image_url` parts (`engines/vision.py`: the prompt ids then hold every image pad, and the
response's `prompt_images` holds the resized images, the reference training rebuilds pixels from);
other media, and images to a text-only model, are refused with a 400. Admin routes need the bearer token the
app was built with (`admin_auth.py`) on every bind. Generation requests that arrive while the engine sleeps wait
for it at most `sleep_wait_s` seconds, then get a 503 naming the sleep.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from agentrl.rollout._openai_protocol import (
    COMPLETIONS_MAX_TOKENS,
    LOGPROB_VALUES_FIELD,
    PROMPT_LIMIT_CODE,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    RequestError,
    TokenText,
    build_chat_logprobs,
    build_completion_logprobs,
    build_error,
    build_usage,
    format_validation_error,
    logit_bias_error,
    new_id,
    now,
    top_logprobs_error,
)
from agentrl.rollout._sse import Event, sse_body, stream_chat, stream_completions
from agentrl.rollout.admin_auth import AdminAuthError, resolve_admin_token
from agentrl.rollout.chat import ChatRenderCache, parse_tool_calls
from agentrl.rollout.continuation import CONTINUED_FIELD, continue_prompt
from agentrl.rollout.engines.constraints import Constraint, ConstraintError, build_constraint
from agentrl.rollout.engines.vision import (
    IMAGE_PART_TYPES,
    ImageInputs,
    build_image_prompt,
    collect_image_refs,
)
from agentrl.rollout.prometheus import render_prometheus
from agentrl.rollout.server_admin import SLEEP_WAIT_S, add_admin_routes, wait_until_awake
from agentrl.types import SamplingParams

__all__ = ["build_server_app", "RequestError"]


class _Server:
    """What every route needs: the engine, tokenizer, names and limits."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        max_n: int,
        sleep_wait_s: float,
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_model_len, self.max_n, self.sleep_wait_s = max_model_len, max_n, sleep_wait_s
        self.token_text = TokenText(tokenizer)
        self.chat_prompts = ChatRenderCache(tokenizer)

    def check_prompt(self, prompt_ids: list[int], param: str, max_prompt_tokens: int | None = None) -> None:
        """Refuse a prompt longer than `max_prompt_tokens` (the request's `agentrl_max_prompt_tokens`, which
        the gateway sets to `data.max_prompt_length`) or one that leaves no room in `max_model_len`; both
        answer 400 with code `max_prompt_length_exceeded`, before anything is generated."""
        if max_prompt_tokens is not None and len(prompt_ids) > max_prompt_tokens:
            raise RequestError(
                f"{param}: the prompt has {len(prompt_ids)} tokens, more than the {max_prompt_tokens} allowed "
                "(data.max_prompt_length); shorten the history you send",
                param,
                code=PROMPT_LIMIT_CODE,
            )
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"{param}: the prompt has {len(prompt_ids)} tokens, but max_model_len is {self.max_model_len} "
                "(the prompt plus at least one completion token must fit)",
                param,
                code=PROMPT_LIMIT_CODE,
            )

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise RequestError(
                f"n: {n} is above this server's cap of {self.max_n} completions per request", "n"
            )

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        return min(requested or self.max_model_len, self.max_model_len - prompt_len)

    def check_request(self, req: Any, default_max_tokens: int | None = None) -> None:
        """Refusals every route shares: an unknown model (404), `n` above the cap, `min_tokens` too large."""
        served = {self.model_name, getattr(self.engine, "lora_adapter", None)} - {None}
        if req.model is not None and req.model not in served:
            raise RequestError(
                f"model: the model `{req.model}` does not exist; this server serves {sorted(served)}",
                "model",
                404,
            )
        self.check_n(req.n)
        if error := req.min_tokens_error(default_max_tokens):
            raise RequestError(f"min_tokens: {error}", "min_tokens")
        vocab_size = getattr(self.engine, "vocab_size", None) or len(self.tokenizer)
        if error := logit_bias_error(req.logit_bias, vocab_size):
            raise RequestError(f"logit_bias: {error}", "logit_bias")


_MEDIA_PARTS = ("image_url", "image", "input_image", "video", "video_url", "input_audio", "audio_url")


def _refuse_media(server: _Server, req: ChatCompletionRequest) -> None:
    """Refuse media the engine cannot see: an image to a text-only model would become placeholder tokens
    with no pixels behind them; video and audio are never served."""
    images_ok = getattr(server.engine, "accepts_images", False)
    for i, message in enumerate(req.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            kind = part.get("type") or next((k for k in _MEDIA_PARTS if k in part), None)
            if kind in IMAGE_PART_TYPES and images_ok:
                continue
            if kind in _MEDIA_PARTS:
                raise RequestError(
                    f"messages.{i}.content.{j}: a '{kind}' part was sent, but `{server.model_name}` is served "
                    "text-only here (the embedded engine takes token ids, no pixels or audio)",
                    f"messages.{i}.content.{j}",
                )


def _chat_constraint(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> Constraint | None:
    """The format a forced tool call or a JSON response format asks for (None: free text)."""
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    response_format = req.response_format.model_dump(by_alias=True) if req.response_format else None
    try:
        return build_constraint(tools, choice, response_format, req.parallel_tool_calls)
    except ConstraintError as error:
        raise RequestError(str(error), error.param) from error


class _RenderedChat(NamedTuple):
    """A chat request's prompt: its ids (image pads expanded), whether to parse tool calls, its pixels, and
    whether it continued the ids the request carried (`continuation.py`: True, the reason not, or None)."""

    prompt_ids: list[int]
    parse_tools: bool
    images: ImageInputs | None
    continued: bool | str | None


def _render_chat_request(server: _Server, req: ChatCompletionRequest) -> _RenderedChat:
    _refuse_media(server, req)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    messages = [m.model_dump(exclude_none=True) | {"content": m.content} for m in req.messages]
    refs = collect_image_refs(messages)
    prompt_ids, continued = None, None
    try:
        if req.agentrl_continuation is not None and not refs:
            asked = req.agentrl_continuation
            prompt_ids, why = continue_prompt(
                server.tokenizer, asked.prefix_ids, messages, asked.history, tools
            )
            continued = True if prompt_ids is not None else why
        if prompt_ids is None:
            prompt_ids = server.chat_prompts.render(messages, tools=tools)
    except ValueError as error:
        raise RequestError(str(error), "messages") from error
    images = None
    if refs:
        image_token = int(server.engine.model.config.image_token_id)
        try:
            prompt_ids, images = build_image_prompt(
                prompt_ids, refs, server.engine.image_processor, image_token
            )
        except (ValueError, OSError) as error:
            field = next((f for f, _ in refs if str(error).startswith(f)), "messages")
            raise RequestError(str(error), field) from error
    server.check_prompt(prompt_ids, "messages", req.agentrl_max_prompt_tokens)
    return _RenderedChat(prompt_ids, bool(tools) and req.tool_choice != "none", images, continued)


async def _chat(server: _Server, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[Event]:
    """The answer as a dict, or with `stream: true` its events (`_sse.py`) as they are generated."""
    server.check_request(req)
    if error := top_logprobs_error(req.logprobs, req.top_logprobs):
        raise RequestError(f"top_logprobs: {error}", "top_logprobs")
    rendered = _render_chat_request(server, req)
    prompt_ids, images = rendered.prompt_ids, rendered.images
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    extra = {"constraint": constraint} if (constraint := _chat_constraint(req, tools)) else {}
    await wait_until_awake(server.engine, server.sleep_wait_s)
    params = req.to_sampling_params(server.max_tokens(req.requested_max_tokens(), len(prompt_ids)))
    top = (req.top_logprobs or 0) if req.logprobs else 0
    version = server.engine.policy_version
    if req.stream:
        events = _start(server.engine.stream, prompt_ids, params, top, images, **extra)
        final = partial(_chat_body, server, req, rendered, version) if req.agentrl_final_body else None
        return stream_chat(server, req, prompt_ids, events, rendered.parse_tools, version, final)
    outputs = await _run(server.engine.generate, prompt_ids, params, top, images, **extra)
    return _chat_body(server, req, rendered, version, outputs, new_id("chatcmpl"), now())


def _chat_body(
    server: _Server,
    req: ChatCompletionRequest,
    rendered: _RenderedChat,
    version: int,
    outputs: list[Any],
    response_id: str,
    created: int,
) -> dict[str, Any]:
    """The unstreamed chat answer from the engine's finished outputs; a stream with `agentrl_final_body` ends
    with the same, so the gateway records one thing either way."""
    choices = []
    for i, out in enumerate(outputs):
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        finish = out.finish_reason
        if rendered.parse_tools:
            parsed = parse_tool_calls(out.text)
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"], finish = parsed.tool_calls, "tool_calls"
            if parsed.error:
                message["tool_call_error"] = parsed.error
        choice: dict[str, Any] = {"index": i, "message": message, "logprobs": None, "finish_reason": finish}
        if req.logprobs:
            choice["logprobs"] = build_chat_logprobs(
                server.token_text, out.token_ids, out.logprobs, out.top_logprobs
            )
        if req.agentrl_logprob_values:
            choice[LOGPROB_VALUES_FIELD] = list(out.logprobs)
        if req.return_token_ids:
            choice["token_ids"] = out.token_ids
        choices.append(choice)
    response: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": req.model or server.model_name,
        "choices": choices,
        "usage": build_usage(len(rendered.prompt_ids), sum(len(o.token_ids) for o in outputs)),
        "policy_version": version,
    }
    if rendered.continued is not None:
        response[CONTINUED_FIELD] = rendered.continued
    if req.return_token_ids:
        response["prompt_token_ids"] = rendered.prompt_ids
        if rendered.images is not None:
            response["prompt_images"] = rendered.images.images
    return response


def _completion_prompts(
    server: _Server, prompt: Any, max_prompt_tokens: int | None = None
) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise RequestError("prompt: must not be empty", "prompt")
    ids = []
    for i, item in enumerate(prompts):
        tokens = server.tokenizer(item)["input_ids"] if isinstance(item, str) else list(item)
        if not tokens:
            raise RequestError(f"prompt[{i}]: is empty", "prompt")
        server.check_prompt(tokens, "prompt", max_prompt_tokens)
        ids.append(tokens)
    return ids


async def _completions(server: _Server, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[Event]:
    """As `_chat`: a dict, or the stream's events."""
    server.check_request(req, default_max_tokens=COMPLETIONS_MAX_TOKENS)
    if req.echo:
        raise RequestError("echo: not supported by the embedded engine", "echo")
    prompts = _completion_prompts(server, req.prompt, req.agentrl_max_prompt_tokens)
    top = req.logprobs or 0
    await wait_until_awake(server.engine, server.sleep_wait_s)
    version = server.engine.policy_version
    params = [
        req.to_sampling_params(server.max_tokens(req.max_tokens or COMPLETIONS_MAX_TOKENS, len(p)))
        for p in prompts
    ]
    if req.stream:
        streams = [_start(server.engine.stream, p, sp, top) for p, sp in zip(prompts, params, strict=True)]
        final = partial(_completion_body, server, req, prompts, version) if req.agentrl_final_body else None
        return stream_completions(server, req, prompts, streams, version, final)
    results = await asyncio.gather(
        *[_run(server.engine.generate, p, sp, top) for p, sp in zip(prompts, params, strict=True)]
    )
    return _completion_body(server, req, prompts, version, results, new_id("cmpl"), now())


def _completion_body(
    server: _Server,
    req: CompletionRequest,
    prompts: list[list[int]],
    version: int,
    results: list[list[Any]],
    response_id: str,
    created: int,
) -> dict[str, Any]:
    """The unstreamed completions answer from each prompt's finished outputs (also a stream's final body)."""
    choices = []
    for p_index, (prompt_ids, outputs) in enumerate(zip(prompts, results, strict=True)):
        for i, out in enumerate(outputs):
            choice: dict[str, Any] = {
                "index": p_index * req.n + i,
                "text": out.text,
                "logprobs": None,
                "finish_reason": out.finish_reason,
            }
            if req.logprobs is not None:
                choice["logprobs"] = build_completion_logprobs(
                    server.token_text, out.token_ids, out.logprobs, out.top_logprobs
                )
            if req.agentrl_logprob_values:
                choice[LOGPROB_VALUES_FIELD] = list(out.logprobs)
            if req.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = prompt_ids, out.token_ids
            choices.append(choice)
    completion_tokens = sum(len(o.token_ids) for outs in results for o in outs)
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": req.model or server.model_name,
        "choices": choices,
        "usage": build_usage(sum(len(p) for p in prompts), completion_tokens),
        "policy_version": version,
    }


def _start(
    stream_fn: Any, prompt_ids: list[int], params: SamplingParams, top: int, images: Any = None, **extra: Any
) -> Any:
    """`extra`: the `constraint`, passed only when there is one (engines without constraints stay usable)."""
    try:
        if images is not None:
            return stream_fn(prompt_ids, params, top_logprobs=top, images=images, **extra)
        return stream_fn(prompt_ids, params, top_logprobs=top, **extra)
    except ConstraintError as error:
        raise RequestError(str(error), error.param) from error
    except ValueError as error:
        raise RequestError(str(error), "prompt") from error


async def _run(
    generate_fn: Any,
    prompt_ids: list[int],
    params: SamplingParams,
    top: int,
    images: Any = None,
    **extra: Any,
) -> Any:
    try:
        if images is not None:
            return await generate_fn(prompt_ids, params, top_logprobs=top, images=images, **extra)
        return await generate_fn(prompt_ids, params, top_logprobs=top, **extra)
    except ConstraintError as error:
        raise RequestError(str(error), error.param) from error
    except ValueError as error:
        raise RequestError(str(error), "prompt") from error


class DirectCalls:
    """The server's generation routes as Python calls, for a `RolloutPool` in the same process (`app.state.direct`).

    The answer is what the HTTP route would send, as a dict (or, streamed, its events as dicts), without the
    ASGI hop and the JSON encoding and parsing of every token's logprob entry on the way back
    (docs/benchmarks.md measures the hop: through `agentrl serve`'s gateway it cost a third of the request
    throughput of streamed calls).
    """

    _ROUTES = {
        "/v1/chat/completions": (ChatCompletionRequest, _chat),
        "/v1/completions": (CompletionRequest, _completions),
    }

    def __init__(self, server: _Server) -> None:
        self._server = server

    async def call(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """(status, body) of POST `path`; errors answer as over HTTP (400 naming the field, 409, ...); an
        exception of the engine propagates (over HTTP it is a 500: the pool fails over either way). None for
        another path or a streamed request (`stream`)."""
        if body.get("stream"):
            return None
        return await self._answer(path, body)

    async def stream(
        self, path: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]] | AsyncIterator[Event] | None:
        """POST `path` with `stream: true`: its events as the HTTP route would send them (close the iterator
        to stop generating, as a client that hangs up does), or (status, error body) for a refused request."""
        answer = await self._answer(path, {**body, "stream": True})
        if answer is not None and answer[0] == 200 and not isinstance(answer[1], dict):
            return answer[1]
        return answer

    async def _answer(self, path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        route = self._ROUTES.get(path)
        if route is None:
            return None
        model, handler = route
        try:
            return 200, await handler(self._server, model.model_validate(body))
        except ValidationError as error:
            message, param = format_validation_error(list(error.errors()))
            return 400, build_error(message, param)
        except RequestError as error:
            return error.status, build_error(error.message, error.param, error.status, error.code)


def _http_answer(answer: dict[str, Any] | AsyncIterator[Event]) -> Any:
    """A route's answer: the dict as JSON, a stream's events as server-sent events."""
    if isinstance(answer, dict):
        return answer
    return StreamingResponse(sse_body(answer), media_type="text/event-stream")


def build_server_app(
    engine: Any,
    tokenizer: Any,
    *,
    model_name: str,
    max_model_len: int | None = None,
    max_n: int = 16,
    admin_token: str | None = None,
    sleep_wait_s: float = SLEEP_WAIT_S,
) -> FastAPI:
    """The OpenAI-compatible app over `engine` (an `EmbeddedEngine` or anything with its methods).

    `admin_token`: the bearer token admin routes require (default: this process's, `admin_auth.py`; read it
    back from `app.state.admin_token`). `sleep_wait_s`: how long a generation request waits for a sleeping
    engine before its 503.
    """
    max_model_len = int(max_model_len or engine.max_model_len)
    server = _Server(engine, tokenizer, model_name, max_model_len, max_n, sleep_wait_s)
    app = FastAPI(title="agentrl embedded engine")
    app.state.server, app.state.admin_token = server, resolve_admin_token(admin_token)
    app.state.direct = DirectCalls(server)

    @app.exception_handler(AdminAuthError)
    async def _denied(_: Request, exc: AdminAuthError) -> JSONResponse:
        return JSONResponse(build_error(exc.message, None, exc.status), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = format_validation_error(list(exc.errors()))
        return JSONResponse(build_error(message, param), status_code=400)

    @app.exception_handler(RequestError)
    async def _refused(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(build_error(exc.message, exc.param, exc.status, exc.code), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # An unknown path or method: the same error shape as every other refusal.
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(build_error(message, None, exc.status_code), status_code=exc.status_code)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Any:
        return _http_answer(await _chat(server, req))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        return _http_answer(await _completions(server, req))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [
            {
                "id": model_name,
                "object": "model",
                "created": now(),
                "owned_by": "agentrl",
                "root": model_name,
                "parent": None,
                "max_model_len": server.max_model_len,
            }
        ]
        if getattr(engine, "lora_adapter", None):
            data.append(
                {
                    "id": engine.lora_adapter,
                    "object": "model",
                    "created": now(),
                    "owned_by": "agentrl",
                    "root": engine.lora_adapter,
                    "parent": model_name,
                    "max_model_len": server.max_model_len,
                }
            )
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "sleeping" if getattr(engine, "is_sleeping", False) else "ok"}

    add_admin_routes(app, engine, app.state.admin_token)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        stats = dict(engine.stats())
        stats["policy_version"] = engine.policy_version
        stats["weights_fingerprint"] = await asyncio.to_thread(engine.weights_fingerprint)
        return stats

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = render_prometheus(engine.stats(), model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
