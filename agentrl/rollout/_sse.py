"""Server-sent events for `stream: true`, in OpenAI's chunk shape, sent as tokens arrive.

Text is streamed per decode step. Two things are held back until they are safe: a trailing
incomplete UTF-8 character (a byte-level token can end mid-character) and, when the request has
stop strings, the last `len(longest stop) - 1` characters (they might be the start of a stop
string, which must not be shown). With tools in a chat request, the output is buffered and sent at
the end as content plus tool-call deltas, because a `<tool_call>` block is only parseable whole.
With `final_body` (the request's `agentrl_final_body`), the last event before `[DONE]` is
`{"agentrl_final_body": body}`: the unstreamed answer built from the finished outputs, which the gateway
records; it is left out when generation failed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from agentrl.rollout._openai_protocol import (
    FINAL_BODY_FIELD,
    build_chat_logprobs,
    build_completion_logprobs,
    build_error,
    build_usage,
    new_id,
    now,
)
from agentrl.rollout.chat import parse_tool_calls

Event = dict[str, Any] | str
"""One streamed event: an OpenAI chunk (or error, usage, final body) as a dict, or the closing `"[DONE]"`."""


def dumps_sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event (`data: ...` and a blank line)."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def sse_body(events: AsyncIterator[Event]) -> AsyncIterator[str]:
    """The SSE text of a stream's events (`stream_chat`, `stream_completions`), for the HTTP route."""
    async for event in events:
        yield dumps_sse(event)


async def read_sse(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The `data` of each server-sent event in `lines` (what a client of `dumps_sse` reads back)."""
    data: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)


class _IncrementalText:
    """Turns a completion's growing token list into safe-to-send text deltas."""

    def __init__(self, decode: Any, stops: list[str]) -> None:
        self._decode = decode
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""

    def push(self, token_ids: list[int], final_text: str | None) -> str:
        self.token_ids.extend(token_ids)
        if final_text is not None:
            text = final_text
        else:
            text = self._decode(self.token_ids).rstrip("\ufffd")
            text = text[: len(text) - self._hold] if self._hold else text
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


async def _merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Events of several engine streams as they come: (stream number, event). One stream (every chat request,
    most completions) is read directly: a task and a queue between it and the response would cost each decode
    step's event two more turns of the event loop, which shares the host with the engine."""
    if len(streams) == 1:
        try:
            async for event in streams[0]:
                yield 0, event
        finally:  # a client gone mid-answer: the engine stream's own cleanup cancels its request now
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(number: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for event in stream:
                await queue.put((number, event))
        except Exception as error:  # delivered to the consumer, which reports it in the stream
            await queue.put((number, error))
        finally:
            await queue.put((number, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            number, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield number, item
    finally:
        for task in tasks:
            task.cancel()


FinalBody = Callable[[Any, str, int], dict[str, Any]]
"""(finished outputs, response id, created) -> the unstreamed response body (`app.py` builds both)."""


async def stream_chat(
    server: Any,
    req: Any,
    prompt_ids: list[int],
    events: AsyncIterator[Any],
    parse_tools: bool,
    version: int,
    final_body: FinalBody | None = None,
) -> AsyncIterator[Event]:
    """Events of a streamed chat completion (role chunk, content/tool-call deltas, usage, final body, [DONE])."""
    head = {
        "id": new_id("chatcmpl"),
        "object": "chat.completion.chunk",
        "created": now(),
        "model": req.model or server.model_name,
    }
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    texts = [_IncrementalText(server.engine.decode, stops) for _ in range(req.n)]
    first: dict[str, Any] = {
        **head,
        "choices": [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(req.n)
        ],
        "policy_version": version,
    }
    if req.return_token_ids:
        first["prompt_token_ids"] = prompt_ids
    yield first
    completion_tokens, outputs, failed = 0, [None] * req.n, False
    try:
        async for _, event in _merge([events]):
            completion_tokens += len(event.token_ids)
            outputs[event.index] = event.output or outputs[event.index]
            text = texts[event.index]
            final = event.output.text if event.output is not None else None
            delta: dict[str, Any] = {}
            finish = event.finish_reason
            if parse_tools:
                text.token_ids.extend(event.token_ids)
                if final is not None:
                    parsed = parse_tool_calls(final)
                    if parsed.content:
                        delta["content"] = parsed.content
                    if parsed.tool_calls:
                        finish = "tool_calls"
                        delta["tool_calls"] = [
                            {"index": k, **call} for k, call in enumerate(parsed.tool_calls)
                        ]
                    if parsed.error:
                        delta["tool_call_error"] = parsed.error
            else:
                piece = text.push(event.token_ids, final)
                if piece:
                    delta["content"] = piece
            choice: dict[str, Any] = {
                "index": event.index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
            }
            if req.logprobs:
                choice["logprobs"] = build_chat_logprobs(
                    server.token_text, event.token_ids, event.logprobs, event.top_logprobs
                )
            if req.return_token_ids:
                choice["token_ids"] = event.token_ids
            if delta or finish or req.return_token_ids or req.logprobs:
                yield {**head, "choices": [choice]}
    except Exception as error:  # the stream has started: report in-band, as OpenAI does
        failed = True
        yield build_error(f"generation failed: {error}", None, 500)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield {**head, "choices": [], "usage": build_usage(len(prompt_ids), completion_tokens)}
    if final_body is not None and not failed:
        yield {FINAL_BODY_FIELD: final_body(outputs, head["id"], head["created"])}
    yield "[DONE]"


async def stream_completions(
    server: Any,
    req: Any,
    prompts: list[list[int]],
    streams: list[AsyncIterator[Any]],
    version: int,
    final_body: FinalBody | None = None,
) -> AsyncIterator[Event]:
    """Events of a streamed /v1/completions call; choice index = prompt number * n + completion."""
    head = {
        "id": new_id("cmpl"),
        "object": "text_completion",
        "created": now(),
        "model": req.model or server.model_name,
        "policy_version": version,
    }
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    texts: dict[int, _IncrementalText] = {}
    sent_prompt: set[int] = set()
    completion_tokens, failed = 0, False
    outputs: list[list[Any]] = [[None] * req.n for _ in prompts]
    try:
        async for number, event in _merge(streams):
            outputs[number][event.index] = event.output or outputs[number][event.index]
            index = number * req.n + event.index
            text = texts.setdefault(index, _IncrementalText(server.engine.decode, stops))
            offset = len(text.sent)
            piece = text.push(event.token_ids, event.output.text if event.output is not None else None)
            completion_tokens += len(event.token_ids)
            choice: dict[str, Any] = {
                "index": index,
                "text": piece,
                "logprobs": None,
                "finish_reason": event.finish_reason,
            }
            if req.logprobs is not None:
                choice["logprobs"] = build_completion_logprobs(
                    server.token_text, event.token_ids, event.logprobs, event.top_logprobs, offset
                )
            if req.return_token_ids:
                if index not in sent_prompt:
                    choice["prompt_token_ids"] = prompts[number]
                    sent_prompt.add(index)
                choice["token_ids"] = event.token_ids
            yield {**head, "choices": [choice]}
    except Exception as error:
        failed = True
        yield build_error(f"generation failed: {error}", None, 500)
    if req.stream_options is not None and req.stream_options.include_usage:
        usage = build_usage(sum(len(p) for p in prompts), completion_tokens)
        yield {**head, "choices": [], "usage": usage}
    if final_body is not None and not failed:
        yield {FINAL_BODY_FIELD: final_body(outputs, head["id"], head["created"])}
    yield "[DONE]"
