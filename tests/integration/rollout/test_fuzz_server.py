"""Fuzzing a real embedded server on loopback with hypothesis: >= 1,000 generated requests against the chat,
completions and admin routes, no answer of 5xx, the server healthy afterwards.

Bodies come from the request models' own JSON schemas (`ChatCompletionRequest`, `CompletionRequest`, the admin
bodies), so every field is tried with values in and out of its bounds; a share of values, bodies and headers is
replaced by arbitrary JSON or bytes. Each example is a batch of requests sent at once (the engine batches them)
plus one admin call (no token, a wrong one, or the right one; a sleep the right token got is undone at once).
The sequence is derandomized: CI runs the same requests every time.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.rollout._openai_protocol import ChatCompletionRequest, CompletionRequest
from agentrl.rollout.app import build_server_app
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.rollout.server_admin import LoadLoraBody, UpdateWeightsBody
from agentrl.rollout.uvicorn_thread import start_server_in_thread

pytestmark = pytest.mark.slow
BATCHES, BATCH = 150, 6  # 150 x (6 generation requests + 1 admin call) = 1,050 requests
MAX_MODEL_LEN = 48
TOKEN = "fuzz-token"

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
"""Any JSON value (NaN and infinities included: Python's json reads them)."""


def from_schema(schema: dict[str, Any], defs: dict[str, Any], junk: float = 0.05) -> st.SearchStrategy:
    """Values for a pydantic JSON schema: mostly valid, at and past the bounds, a share `junk` of any JSON."""
    return _mostly(_valid(schema, defs), JSON, every=round(1 / junk))


def _valid(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy:
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs))
    if "anyOf" in schema:
        return st.one_of(*[from_schema(s, defs) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return _mostly(st.sampled_from(schema["enum"]), st.just(f"not-{schema['enum'][0]}"))
    kind = schema.get("type")
    if kind == "integer":
        low, high = schema.get("minimum", -(2**40)), schema.get("maximum", 2**40)
        return _mostly(
            st.integers(low, min(high, low + 80)), st.sampled_from([low - 1, high + 1, 2**63, -(2**63)])
        )
    if kind == "number":
        return _mostly(st.floats(schema.get("minimum", -4), schema.get("maximum", 4)), st.floats())
    if kind == "string":
        return st.text(max_size=24)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs) if schema.get("items") else JSON
        return st.lists(items, max_size=4)
    if kind == "object" and "properties" in schema:
        fields = {k: from_schema(v, defs) for k, v in schema["properties"].items()}
        return _some_fields(fields, set(schema.get("required", [])))
    return JSON


def _mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy, every: int = 5) -> st.SearchStrategy:
    """`invalid` about one draw in `every`, else `valid`: one bad field is enough to refuse a body, so bad values
    must stay rare for requests to reach generation. (`one_of(v, v, v, w)` does not weigh: hypothesis draws
    each distinct branch alike.)"""
    return st.integers(0, every - 1).flatmap(lambda i: invalid if i == every - 1 else valid)


def _some_fields(
    fields: dict[str, st.SearchStrategy], required: set[str], most: int = 4
) -> st.SearchStrategy:
    """Objects with every required field and at most `most` optional ones: a body with all 25 fields of a chat
    request would nearly always hold one out-of-bounds value, and so never reach generation."""
    optional = sorted(set(fields) - required)
    if not optional:
        return st.fixed_dictionaries({k: fields[k] for k in sorted(required)})
    return st.lists(st.sampled_from(optional), max_size=most, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in [*sorted(required), *keys]})
    )


def body_strategy(model: type, overrides: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Bodies for `model`; the fields in `overrides` are always sent, drawn from there (lengths and prompts that
    keep most generations short)."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    properties = {
        k: overrides[k] if k in overrides else from_schema(v, defs) for k, v in schema["properties"].items()
    }
    return _some_fields(properties, (set(schema.get("required", [])) | set(overrides)) & set(properties))


LENGTH = _mostly(st.integers(1, 8), st.sampled_from([0, -1, None, 10**9, 2**63]))
SHORT = {
    "model": st.sampled_from([None, "tiny"]) | st.text(max_size=8),
    "max_tokens": LENGTH,
    "n": _mostly(st.integers(1, 4), st.sampled_from([0, 5])),
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 200), max_size=8) | JSON,
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}
)
_CHAT_SCHEMA = ChatCompletionRequest.model_json_schema()
MESSAGES = _mostly(
    st.lists(MESSAGE, min_size=1, max_size=3),
    from_schema(_CHAT_SCHEMA["properties"]["messages"], _CHAT_SCHEMA["$defs"]),  # tool turns, parts, junk
)
CHAT = body_strategy(ChatCompletionRequest, {**SHORT, "max_completion_tokens": LENGTH, "messages": MESSAGES})
COMPLETION = body_strategy(CompletionRequest, SHORT)
ROUTES = ["/v1/chat/completions", "/v1/completions"]
RAW = st.binary(max_size=40) | JSON.map(lambda v: json.dumps(v).encode())
"""Bodies that are not a request object at all: bytes, or JSON of another shape."""
GENERATION = _mostly(
    st.tuples(st.just(ROUTES[0]), CHAT) | st.tuples(st.just(ROUTES[1]), COMPLETION),
    st.tuples(st.sampled_from(ROUTES), RAW),
)
ADMIN = st.sampled_from(["/update_weights", "/v1/load_lora_adapter", "/sleep", "/wake_up"]).flatmap(
    lambda path: st.tuples(
        st.just(path),
        body_strategy(UpdateWeightsBody, {}) if path == "/update_weights"
        else body_strategy(LoadLoraBody, {}) if path == "/v1/load_lora_adapter" else st.none() | JSON,
        st.sampled_from([None, "Bearer wrong", f"Bearer {TOKEN}", TOKEN, "Basic eA=="]),
    )
)  # fmt: skip


@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=16, max_model_len=MAX_MODEL_LEN)
    app = build_server_app(engine, tokenizer, model_name="tiny", max_n=4, admin_token=TOKEN, sleep_wait_s=5)
    with start_server_in_thread(app) as handle:
        yield engine, handle.url
    engine.close()


@pytest.fixture(scope="module")
def model():
    from agentrl.models import load_causal_lm

    return load_causal_lm("tiny:qwen2")


@pytest.fixture(scope="module")
def tokenizer():
    from agentrl.models import load_tokenizer

    return load_tokenizer("tiny:qwen2")


async def _send(
    client: httpx.AsyncClient, path: str, body: Any, headers: dict[str, str] | None = None
) -> int:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **(headers or {})}
    async with client.stream("POST", path, content=content, headers=headers) as response:
        await response.aread()  # a stream that breaks half way raises here
        return response.status_code


@pytest.mark.timeout(90)
def test_no_generated_request_gets_a_5xx(server):
    engine, url = server
    statuses: Counter[int] = Counter()
    tried: Counter[str] = Counter()
    failures: list[str] = []
    started = time.monotonic()

    @settings(
        max_examples=BATCHES, deadline=None, derandomize=True, database=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )  # fmt: skip
    @given(st.lists(GENERATION, min_size=BATCH, max_size=BATCH), ADMIN)
    def one_batch(calls: list[tuple[str, Any]], admin: tuple[str, Any, str | None]) -> None:
        found: list[str] = []  # this example's own: hypothesis shrinks a failing one by running variants

        async def go() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                codes = await asyncio.gather(*(_send(client, p, b) for p, b in calls), return_exceptions=True)
                path, body, auth = admin
                codes.append(await _send(client, path, body, {"authorization": auth} if auth else None))
                for (p, b), code in zip([*calls, (path, body)], codes, strict=True):
                    tried[p] += 1
                    statuses[code if isinstance(code, int) else 599] += 1
                    if not isinstance(code, int) or code >= 500:
                        found.append(f"POST {p} {b!r:.300} -> {code!r}")
                if engine.is_sleeping:  # the right token put it to sleep: undo, or the next batch waits
                    await _send(client, "/wake_up", None, {"authorization": f"Bearer {TOKEN}"})

        asyncio.run(go())
        failures.extend(found)
        assert not found, found[:5]

    one_batch()
    elapsed = time.monotonic() - started
    total = sum(statuses.values())
    print(
        f"fuzz: {total} requests in {elapsed:.1f} s; by route {dict(tried)}; by status {dict(sorted(statuses.items()))}"
    )
    assert total >= 1000 and not failures
    assert set(tried) == {"/v1/chat/completions", "/v1/completions", "/update_weights", "/v1/load_lora_adapter",
                          "/sleep", "/wake_up"}  # fmt: skip
    assert statuses[200] >= 100 and statuses[400] >= 100  # both served and refused requests were tried
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    reply = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["text"]) >= 0
    assert engine.policy_version == 0  # no generated body loaded weights or an adapter
