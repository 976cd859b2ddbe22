"""What the gateway's client gets back: the server's answer stripped of what it did not ask for, and streamed.

With `stream: true`, an embedded server streams through the gateway as it generates: the gateway asks it for
`agentrl_final_body` too, relays each chunk (stripped, under the model name the client asked for), keeps the
server's last event (the unstreamed answer, never forwarded) to record the call exactly as an unstreamed one,
then sends the usage chunk and `[DONE]`. A vLLM server's stream has no final body, so there the gateway asks for
the whole answer and replays it as chunks at the end (`replay_stream`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from agentrl.rollout._openai_protocol import FINAL_BODY_FIELD, LOGPROB_VALUES_FIELD, build_error
from agentrl.rollout._sse import dumps_sse
from agentrl.rollout.continuation import CONTINUED_FIELD
from agentrl.rollout.pool import PoolResponse
from agentrl.rollout.pool_stream import PoolStream

_TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "prompt_images")


def strip_response(body: dict[str, Any], req: Any, *, chat: bool) -> dict[str, Any]:
    """Remove the token ids and logprobs the client did not ask for (from a whole answer or one chunk)."""
    body = dict(body)
    body.pop(CONTINUED_FIELD, None)
    choices = [dict(c) for c in body.get("choices") or []]
    for c in choices:
        c.pop(LOGPROB_VALUES_FIELD, None)
    if not req.return_token_ids:
        for f in _TOKEN_FIELDS:
            body.pop(f, None)
            for c in choices:
                c.pop(f, None)
    if (chat and not req.logprobs) or (not chat and req.logprobs is None):
        for c in choices:
            c["logprobs"] = None
    body["choices"] = choices
    return body


def _carries_nothing(chunk: dict[str, Any]) -> bool:
    """A chunk whose choices say nothing once stripped (a decode step of held-back text or a buffered tool
    call): not worth a client's parse."""
    keys = ("delta", "text", "finish_reason", "logprobs", "token_ids")
    return bool(chunk["choices"]) and not any(c.get(k) for c in chunk["choices"] for k in keys)


def _usage_chunk(body: dict[str, Any], chat: bool) -> str:
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": body.get("id"), "object": kind, "created": body.get("created"), "model": body.get("model")}
    return dumps_sse({**head, "choices": [], "usage": body.get("usage")})


async def relay_stream(
    stream: PoolStream,
    req: Any,
    *,
    chat: bool,
    finish: Callable[[PoolResponse], tuple[int, dict[str, Any]]],
) -> AsyncIterator[str]:
    """The client's SSE body of a call the server streams: its chunks as they come, then `finish` (the gateway's
    recording) on the final body, the usage chunk when asked, `[DONE]`. A failure ends the stream with an error
    event and records nothing."""
    final = None
    try:
        async for event in stream.events():
            if FINAL_BODY_FIELD in event:
                final = event[FINAL_BODY_FIELD]
            elif "error" in event:
                yield dumps_sse(event)
                break
            elif not _carries_nothing(chunk := strip_response(event, req, chat=chat)):
                if req.model:
                    chunk["model"] = req.model
                yield dumps_sse(chunk)
        else:
            if not isinstance(final, dict):
                message = f"inference server {stream.server} ended its stream without the final body"
                yield dumps_sse(build_error(message, None, 502))
            else:
                status, body = finish(PoolResponse(200, final, stream.server, stream.policy_version))
                if status != 200:
                    yield dumps_sse(body)
                elif req.stream_options and req.stream_options.include_usage:
                    yield _usage_chunk(body, chat)
    finally:
        await stream.aclose()
    yield dumps_sse("[DONE]")


def replay_stream(body: dict[str, Any], req: Any, *, chat: bool) -> Iterator[str]:
    """A finished answer as OpenAI chunks, for a server that cannot stream its final body (vLLM)."""
    usage = bool(req.stream_options and req.stream_options.include_usage)
    yield from _replay_chat(body) if chat else _replay_completion(body)
    if usage:
        yield _usage_chunk(body, chat)
    yield dumps_sse("[DONE]")


def _replay_chat(body: dict[str, Any]) -> Iterator[str]:
    """Per choice: the role, content (+ tool calls), the finish reason."""
    base = {"id": body.get("id"), "object": "chat.completion.chunk", "created": body.get("created"),
            "model": body.get("model")}  # fmt: skip
    for c in body["choices"]:
        i, msg = c.get("index", 0), c.get("message") or {}
        first: dict[str, Any] = {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]}  # fmt: skip
        if "prompt_token_ids" in body:
            first["prompt_token_ids"] = body["prompt_token_ids"]
        yield dumps_sse(first)
        delta: dict[str, Any] = {}
        if msg.get("content"):
            delta["content"] = msg["content"]
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(msg["tool_calls"])]
        if delta or c.get("logprobs"):
            part = {"index": i, "delta": delta, "logprobs": c.get("logprobs"), "finish_reason": None}
            if "token_ids" in c:
                part["token_ids"] = c["token_ids"]
            yield dumps_sse({**base, "choices": [part]})
        yield dumps_sse({**base, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                              "finish_reason": c.get("finish_reason")}]})  # fmt: skip


def _replay_completion(body: dict[str, Any]) -> Iterator[str]:
    """Per choice: the text, then the finish reason."""
    base = {"id": body.get("id"), "object": "text_completion", "created": body.get("created"),
            "model": body.get("model")}  # fmt: skip
    for c in body["choices"]:
        part = {k: v for k, v in c.items() if k != "finish_reason"}
        yield dumps_sse({**base, "choices": [{**part, "finish_reason": None}]})
        yield dumps_sse({**base, "choices": [{"index": c.get("index", 0), "text": "", "logprobs": None,
                                              "finish_reason": c.get("finish_reason")}]})  # fmt: skip
