"""Token-exact continuation through the gateway: a turn that re-sends its history extends the sampled ids."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from agentrl.models import resolve_model_path
from agentrl.rollout.app import build_server_app
from agentrl.rollout.chat import render_chat
from agentrl.rollout.continuation import turn_end_ids
from agentrl.rollout.engines.embedded import build_embedded_engine
from agentrl.rollout.gateway import Gateway
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.uvicorn_thread import start_server_in_thread
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow
MODEL = "tiny:qwen2-mini"
SYSTEM = {"role": "system", "content": "You add numbers. " * 6}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"which": {"type": "string", "enum": ["first", "second"]}},
                "required": ["which"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server():
    engine = build_embedded_engine(resolve_model_path(MODEL), max_model_len=512, max_num_seqs=8)
    app = build_server_app(engine, engine.tokenizer, model_name=MODEL, max_model_len=512, max_n=4)
    handle = start_server_in_thread(app)
    yield engine, handle
    handle.stop()
    engine.close()


def _gateway(handle, max_tokens: int = 8, **kwargs) -> Gateway:
    pool = RolloutPool([handle], model_name=MODEL, request_timeout=60)
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=3)
    return Gateway(pool, sampling_train=sampling, **kwargs).start()


def _client(gateway: Gateway, session_id: str | None = None) -> tuple[str, openai.OpenAI]:
    url = gateway.open_session(session_id)
    return url.split("/sessions/")[1].split("/")[0], openai.OpenAI(base_url=url, api_key="x", max_retries=0)


def _talk(client, turns: int, tools=None, tool_choice=None) -> list[dict]:
    messages = [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}]
    for turn in range(turns):
        # one call per turn: with parallel calls allowed a random model may not close them within max_tokens
        extra = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": False} if tools else {}
        reply = client.chat.completions.create(model=MODEL, messages=messages, **extra).choices[0].message
        said = reply.model_dump(exclude_none=True)
        if reply.tool_calls:
            messages += [said, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "5"}]
        else:
            messages += [said, {"role": "user", "content": f"Check it again ({turn})."}]
    return messages


def test_each_turn_extends_the_previous_prompt_and_completion(server):
    engine, handle = server
    gateway = _gateway(handle)
    try:
        sid, client = _client(gateway)
        messages = _talk(client, 4)
        traces = gateway.session_traces(sid)
        assert gateway.session_turns.continued == 3 and gateway.session_turns.fallback_count == 0
        assert gateway.session_turns.counts("train") == (3, 0)
        validation_url = gateway.open_session(None, "validation")
        _talk(openai.OpenAI(base_url=validation_url, api_key="x", max_retries=0), 2)
        # training's step metrics read the train sessions' counts only
        assert gateway.session_turns.counts("validation") == (1, 0)
        assert gateway.session_turns.counts("train") == (3, 0) and gateway.session_turns.continued == 4
        tokenizer = engine.tokenizer
        for k in range(1, 4):
            before, now = traces[k - 1], traces[k]
            held = before.prompt_ids + before.response_ids
            history = 2 * k + 1  # system, user, then (assistant, user) per turn: through turn k's reply
            closing = turn_end_ids(tokenizer, None)
            assert tokenizer.decode(closing) == "<|im_end|>\n"  # the template's end of an assistant turn
            closing = closing[1:] if held[-1] == closing[0] else closing
            base = render_chat(tokenizer, messages[:history], add_generation_prompt=False)
            full = render_chat(tokenizer, messages[: history + 1])
            assert full[: len(base)] == base
            assert now.prompt_ids == held + closing + full[len(base) :]
    finally:
        gateway.stop()


def test_a_rewritten_history_or_edited_reply_is_rendered_and_counted(server):
    engine, handle = server
    gateway = _gateway(handle)

    def ask(client, messages):
        reply = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message
        return [*messages, reply.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]

    try:
        sid, client = _client(gateway)
        messages = ask(client, [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}])
        rewritten = [SYSTEM, {"role": "user", "content": "What is 7 + 1?"}, *messages[2:]]
        messages = ask(client, rewritten)
        assert gateway.session_turns.fallbacks == {"history_rewritten": 1}
        assert gateway.session_traces(sid)[-1].prompt_ids == render_chat(engine.tokenizer, rewritten)
        latest = ask(client, messages)  # extends the rewritten turn: continues again
        assert gateway.session_turns.continued == 1
        edited = [*latest[:-2], {**latest[-2], "content": "I changed my answer."}, latest[-1]]
        ask(client, edited)
        assert gateway.session_turns.fallbacks == {"history_rewritten": 1, "reply_edited": 1}
    finally:
        gateway.stop()


def test_tool_calls_continue_from_the_ids_that_produced_them(server):
    _, handle = server
    gateway = _gateway(handle, max_tokens=120)  # room for a whole forced call
    try:
        sid, client = _client(gateway, "tool-calls")  # a fixed session: the same sampling seeds every run
        _talk(client, 3, tools=TOOLS, tool_choice="required")
        traces = gateway.session_traces(sid)
        assert all(t.tool_calls for t in traces)
        assert gateway.session_turns.continued == 2
        for before, now in zip(traces, traces[1:], strict=False):
            assert now.prompt_ids[: len(before.prompt_ids) + len(before.response_ids)] == (
                before.prompt_ids + before.response_ids
            )
    finally:
        gateway.stop()


def test_off_every_turn_is_rendered_from_its_messages(server):
    engine, handle = server
    gateway = _gateway(handle, cumulative_token_mode=False)
    try:
        sid, client = _client(gateway)
        messages = _talk(client, 3)
        assert gateway.session_turns.continued == 0 and gateway.session_turns.fallback_count == 0
        assert gateway.session_traces(sid)[-1].prompt_ids == render_chat(engine.tokenizer, messages[:-2])
    finally:
        gateway.stop()


def _prometheus(url: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name.split("{")[0]] = float(value)
    return samples


def test_an_eight_turn_conversation_is_served_from_the_prefix_cache(server):
    """Turns 2-8 re-send the whole history; vLLM's prefix-cache counters on `/metrics` say most of it was reused."""
    _, handle = server
    gateway = _gateway(handle, max_tokens=16)
    try:
        _, client = _client(gateway)
        messages = [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}]
        for turn in range(8):
            if turn == 1:
                time.sleep(0.05)  # the first turn's row parks just after its answer
                before = _prometheus(handle.url)
            reply = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message
            messages += [
                reply.model_dump(exclude_none=True),
                {"role": "user", "content": f"Tool says {turn}."},
            ]
        after = _prometheus(handle.url)
        queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
        hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        assert queries > 0 and hits / queries >= 0.8
        assert after["vllm:generation_tokens_total"] > before["vllm:generation_tokens_total"]
        assert after["vllm:num_requests_running"] == 0 and 0 < after["vllm:kv_cache_usage_perc"] <= 1
        assert gateway.session_turns.continued == 7
    finally:
        gateway.stop()
