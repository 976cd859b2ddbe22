"""The fast request transform gives openai's own answer for every body, and skips openai's walk only for plain ones."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import httpx
import openai
import pytest
from openai._types import NOT_GIVEN, omit
from openai._utils import async_maybe_transform
from openai._utils._transform import PropertyInfo
from openai.types.chat import ChatCompletionMessage, completion_create_params
from openai.types.completion_create_params import CompletionCreateParamsNonStreaming as TextParams
from typing_extensions import TypedDict

from agentrl.rollout.client_transform import (
    declares_no_rewrite,
    fast_path_body,
    fast_transform,
    install_fast_transform,
)

ChatParams = completion_create_params.CompletionCreateParamsNonStreaming
ChatStreamParams = completion_create_params.CompletionCreateParamsStreaming


def _history(turns: int) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": "You are terse."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"observation {t}"})
        messages.append({"role": "assistant", "content": f"answer {t}"})
    messages.append({"role": "user", "content": "go on"})
    return messages


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
]

PLAIN_BODIES = {
    "multi-turn history, omitted values": {
        "messages": _history(8), "model": "m", "max_tokens": 16, "logprobs": True, "temperature": 0.7,
        "audio": omit, "n": NOT_GIVEN, "stop": ["\n"], "seed": None,
    },
    "tool calls and a tool answer": {
        "messages": [
            {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ],
        "model": "m", "tools": TOOLS, "tool_choice": "auto",
    },
    "content parts with an image": {
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]}],
        "model": "m", "min_tokens": 4, "ignore_eos": True,
    },
}  # fmt: skip


def _transform(data, request_type):
    return asyncio.run(async_maybe_transform(data, request_type))


@pytest.mark.parametrize("name", list(PLAIN_BODIES))
@pytest.mark.parametrize("request_type", [ChatParams, ChatStreamParams])
def test_a_plain_body_takes_the_fast_path_and_equals_openais_walk(name, request_type):
    body = PLAIN_BODIES[name]
    fast = fast_path_body(body, request_type)
    assert fast is not None, name
    assert fast == _transform(body, request_type)
    assert "audio" not in fast and "n" not in fast  # omitted values dropped, as openai drops them
    assert json.dumps(fast)  # plain JSON


def test_a_completions_body_takes_the_fast_path_too():
    body = {"prompt": [1, 2, 3], "model": "m", "max_tokens": 4, "echo": omit}
    assert fast_path_body(body, TextParams) == _transform(body, TextParams)


NOT_PLAIN = {
    "a pydantic message from an earlier answer": lambda: {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi"},
            ChatCompletionMessage(role="assistant", content="hello"),
            {"role": "user", "content": "again"},
        ],
    },
    "messages as a generator": lambda: {"model": "m", "messages": (m for m in _history(1))},
    "messages as a tuple": lambda: {"model": "m", "messages": tuple(_history(1))},
    "an omitted value inside a message": lambda: {"model": "m", "messages": [{"role": "user", "content": "x", "name": omit}]},
}  # fmt: skip


@pytest.mark.parametrize("name", list(NOT_PLAIN))
def test_other_bodies_go_through_openais_walk(name):
    assert fast_path_body(NOT_PLAIN[name](), ChatParams) is None, name


class _Aliased(TypedDict, total=False):
    beta_header: Annotated[str, PropertyInfo(alias="openai-beta")]
    nested: list[dict]


def test_a_request_type_that_renames_a_key_never_takes_the_fast_path():
    assert declares_no_rewrite(ChatParams) and declares_no_rewrite(TextParams)
    assert not declares_no_rewrite(_Aliased)
    body = {"beta_header": "x", "nested": []}
    assert _transform(body, _Aliased) == {
        "openai-beta": "x",
        "nested": [],
    }  # what the fast path would get wrong
    assert fast_path_body(body, _Aliased) is None


def _recording_app(received: list[dict]):
    async def app(scope, receive, send):
        assert scope["type"] == "http"
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        received.append(json.loads(b"".join(chunks)))
        answer = {
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        }  # fmt: skip
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    return app


def test_a_real_client_sends_the_same_json_with_the_fast_path_installed():
    assert install_fast_transform()
    assert install_fast_transform()  # installing twice wraps once
    received: list[dict] = []
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=_recording_app(received)))
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="k", http_client=http, max_retries=0)
    pydantic_history = NOT_PLAIN["a pydantic message from an earlier answer"]()["messages"]

    async def send_all():
        for messages in (
            _history(8),
            PLAIN_BODIES["tool calls and a tool answer"]["messages"],
            pydantic_history,
        ):
            await client.chat.completions.create(
                model="m", messages=messages, max_tokens=8, extra_body={"min_tokens": 2}
            )
            with fast_transform():
                await client.chat.completions.create(
                    model="m", messages=messages, max_tokens=8, extra_body={"min_tokens": 2}
                )

    asyncio.run(send_all())
    assert len(received) == 6
    for without, with_fast_path in zip(received[::2], received[1::2], strict=True):
        assert with_fast_path == without
    assert received[4]["messages"][1] == {"role": "assistant", "content": "hello"}
