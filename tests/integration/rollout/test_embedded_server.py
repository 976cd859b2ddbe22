"""The embedded server through the official openai client (sync and async), plus raw HTTP for bad input."""

import asyncio
import copy
import json
import time

import httpx
import openai
import pytest
import torch

from agentrl.rollout.admin_auth import admin_headers, process_admin_token
from agentrl.rollout.app import build_server_app
from agentrl.rollout.chat import render_chat
from agentrl.rollout.engines.embedded import EmbeddedEngine, fingerprint_state_dict
from agentrl.rollout.uvicorn_thread import start_server_in_thread
from tests._prometheus import prometheus_samples

pytestmark = pytest.mark.slow
MODEL = "tiny:qwen2-mini"
USER = [{"role": "user", "content": "Alice has 5 apples and buys 7 more. How many now?"}]


def _serve(model, tokenizer, max_model_len=256):
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=64, max_model_len=max_model_len)
    app = build_server_app(engine, tokenizer, model_name="tiny", max_model_len=max_model_len, max_n=4)
    return engine, start_server_in_thread(app)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    engine, handle = _serve(model, tokenizer)
    yield handle
    handle.stop()
    engine.close()


@pytest.fixture
def admin_server(model, tokenizer):
    engine, handle = _serve(model, tokenizer)
    yield engine, handle
    handle.stop()
    engine.close()


def _client(handle):
    return openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0)


def test_chat_returns_token_ids_and_exact_logprobs(server, model, tokenizer):
    reply = _client(server).chat.completions.create(
        model="tiny",
        messages=USER,
        max_completion_tokens=24,
        temperature=0.9,
        seed=4,
        n=2,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    extra = reply.model_extra
    prompt = render_chat(tokenizer, USER)
    assert extra["prompt_token_ids"] == prompt and extra["policy_version"] == 0
    assert reply.usage.prompt_tokens == len(prompt)
    for choice in reply.choices:
        ids = choice.model_extra["token_ids"]
        assert len(ids) == len(choice.logprobs.content) <= 24 and choice.message.role == "assistant"
        assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        # sampled at temperature 0.9: the logprobs are of softmax(logits / 0.9), the policy the trainer trains
        reference = torch.log_softmax(logits / 0.9, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        served = torch.tensor([e.logprob for e in choice.logprobs.content])
        assert (reference - served).abs().max().item() < 1e-4
    assert reply.choices[0].model_extra["token_ids"] != reply.choices[1].model_extra["token_ids"]


def test_async_client_chat_and_completions_text_and_token_ids(server, tokenizer):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chat = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
        text = await client.completions.create(
            model="tiny",
            prompt="Bob has",
            max_tokens=6,
            temperature=0,
            logprobs=2,
            extra_body={"return_token_ids": True},
        )
        ids = await client.completions.create(
            model="tiny",
            prompt=[[10, 11, 12], [13, 14]],
            max_tokens=5,
            n=2,
            temperature=1.0,
            extra_body={"return_token_ids": True},
        )
        await client.close()
        return chat, text, ids

    chat, text, ids = asyncio.run(run())
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("length", "stop")
    choice = text.choices[0]
    assert choice.model_extra["prompt_token_ids"] == tokenizer("Bob has")["input_ids"]
    assert len(choice.model_extra["token_ids"]) == len(choice.logprobs.token_logprobs) == 6
    assert [c.index for c in ids.choices] == [0, 1, 2, 3]
    assert [c.model_extra["prompt_token_ids"] for c in ids.choices] == [[10, 11, 12]] * 2 + [[13, 14]] * 2
    assert ids.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in ids.choices)


def test_streaming_chat_assembles_to_the_non_streamed_answer(server):
    client = _client(server)
    kwargs = {"model": "tiny", "messages": USER, "max_tokens": 20, "temperature": 0, "stop": ["apples"]}
    whole = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    chunks = list(
        client.chat.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    token_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert content == whole.choices[0].message.content
    assert token_ids == whole.choices[0].model_extra["token_ids"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(token_ids)


def test_streaming_completions(server):
    client = _client(server)
    whole = client.completions.create(model="tiny", prompt="Count", max_tokens=10, temperature=0)
    stream = client.completions.create(
        model="tiny", prompt="Count", max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text


def _latency_samples(url: str) -> dict[str, float]:
    """`GET /metrics`'s latency histogram samples, by name with labels."""
    samples = prometheus_samples(httpx.get(url + "/metrics").text)
    return {name: value for name, value in samples.items() if "_seconds" in name}


def test_metrics_count_each_finished_requests_latencies_in_vllms_histograms(server):
    """Three requests (one of two completions, one streamed, one chat) each counted once in every phase's
    histogram, whose phases add up: wait + prefill = time to first token, + decode = the whole latency."""
    client = _client(server)
    before = _latency_samples(server.url)
    client.completions.create(model="tiny", prompt="Count", max_tokens=6, n=2)
    list(client.completions.create(model="tiny", prompt="Count", max_tokens=6, stream=True))
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    after = _latency_samples(server.url)
    label = 'model_name="tiny"'

    def added(name: str, part: str) -> float:
        key = f"{name}_{part}{{{label}}}"
        return after[key] - before[key]

    names = [
        "vllm:time_to_first_token_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:e2e_request_latency_seconds",
    ]
    for name in names:
        assert added(name, "count") == 3
        buckets = [value for key, value in after.items() if key.startswith(f"{name}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == after[f"{name}_count{{{label}}}"]
    ttft, queue, prefill, decode, e2e = (added(name, "sum") for name in names)
    assert 0 < ttft < e2e and queue >= 0 and prefill > 0 and decode > 0
    assert abs(queue + prefill - ttft) < 1e-6 and abs(ttft + decode - e2e) < 1e-6


def test_metrics_count_completions_by_how_they_ended_and_their_tokens(server):
    """Two completions cut at their length and a chat answer: each completion counted under its finish reason in
    `vllm:request_success_total` with its prompt and generated tokens, and every token after a completion's first
    once in `vllm:inter_token_latency_seconds`."""
    client = _client(server)
    before = prometheus_samples(httpx.get(server.url + "/metrics").text)
    cut = client.completions.create(
        model="tiny", prompt="Count", max_tokens=6, n=2, extra_body={"ignore_eos": True}
    )
    chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=1.0, seed=3)
    after = prometheus_samples(httpx.get(server.url + "/metrics").text)
    label = 'model_name="tiny"'

    def added(key: str) -> float:
        return after[key] - before[key]

    reasons = [c.finish_reason for c in cut.choices] + [c.finish_reason for c in chat.choices]
    assert reasons[:2] == ["length", "length"]
    for reason in ("stop", "length", "abort", "error"):
        key = f'vllm:request_success_total{{finished_reason="{reason}",{label}}}'
        assert added(key) == reasons.count(reason), reason
    completions, generated = 3, cut.usage.completion_tokens + chat.usage.completion_tokens
    assert cut.usage.completion_tokens == 12
    assert added(f"vllm:request_prompt_tokens_count{{{label}}}") == completions
    assert (
        added(f"vllm:request_prompt_tokens_sum{{{label}}}")
        == 2 * cut.usage.prompt_tokens + chat.usage.prompt_tokens
    )
    assert added(f"vllm:request_generation_tokens_sum{{{label}}}") == generated
    assert added(f"vllm:inter_token_latency_seconds_count{{{label}}}") == generated - completions
    assert added(f"vllm:inter_token_latency_seconds_sum{{{label}}}") > 0
    assert added(f"vllm:request_time_per_output_token_seconds_count{{{label}}}") == completions
    assert added(f"vllm:request_params_max_tokens_sum{{{label}}}") == 6 + 6 + 8
    assert added(f"vllm:request_params_n_sum{{{label}}}") == 2 + 1  # per request, as its longest completion
    assert added(f"vllm:request_max_num_generation_tokens_sum{{{label}}}") == 6 + chat.usage.completion_tokens


def test_a_client_that_leaves_a_stream_frees_its_engine_row(model, tokenizer):
    """A streamed answer whose client goes away after its first chunk stops generating: its row leaves the engine
    long before the 1,900 tokens it asked for (one lost client costs one row, not the engine's time)."""
    engine, handle = _serve(model, tokenizer, max_model_len=2048)
    try:
        body = {"model": "tiny", "prompt": "Count", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", handle.url + "/v1/completions", json=body, timeout=30) as response:
            first = next(line for line in response.iter_lines() if line.startswith("data:"))
            assert json.loads(first[5:])["choices"][0]["finish_reason"] is None
            assert engine.stats()["running"] == 1
        deadline = time.monotonic() + 10
        while engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = engine.stats()
        assert stats["running"] == 0 and stats["waiting"] == 0
        assert stats["tokens_generated"] < 1000
        samples = prometheus_samples(httpx.get(handle.url + "/metrics").text)
        assert samples['vllm:request_success_total{finished_reason="abort",model_name="tiny"}'] == 1.0
        assert samples['vllm:request_generation_tokens_sum{model_name="tiny"}'] == stats["tokens_generated"]
    finally:
        handle.stop()
        engine.close()


def test_tool_call_round_trip_history(server, tokenizer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 5, "b": 7}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "12"},
    ]
    client = _client(server)
    reply = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, max_tokens=8, extra_body={"return_token_ids": True}
    )
    prompt = reply.model_extra["prompt_token_ids"]
    assert prompt == render_chat(tokenizer, messages, tools=tools)
    rendered = tokenizer.decode(prompt)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 7}}\n</tool_call>' in rendered
    assert (
        "<tool_response>\n12\n</tool_response>" in rendered and '"description": "Add two numbers"' in rendered
    )
    streamed = list(
        client.chat.completions.create(
            model="tiny", messages=messages, tools=tools, max_tokens=8, stream=True
        )
    )
    assert streamed[-1].choices[0].finish_reason in ("length", "stop", "tool_calls")
    with pytest.raises(openai.BadRequestError) as info:  # forcing a function that is not in `tools`
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "subtract"}},
        )
    assert info.value.body["param"] == "tool_choice" and "subtract" in info.value.body["message"]


def test_64_concurrent_requests_all_complete(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        calls = [
            client.chat.completions.create(
                model="tiny", max_tokens=16, seed=i, messages=[{"role": "user", "content": f"Question {i}"}]
            )
            for i in range(64)
        ]
        replies = await asyncio.gather(*calls)
        await client.close()
        return replies

    replies = asyncio.run(run())
    assert len(replies) == 64 and all(r.choices[0].finish_reason in ("length", "stop") for r in replies)
    assert all(r.usage.completion_tokens >= 1 for r in replies)


BAD = [
    ("{not json", None, "invalid JSON body"),
    (
        json.dumps({"messages": USER, "temperature": "hot"}),
        "temperature",
        "temperature: Input should be a valid number",
    ),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "messages.0.role", "messages.0.role"),
    (
        json.dumps({"messages": [{"role": "user", "content": "many words " * 300}]}),
        "messages",
        "max_model_len is 256",
    ),
    (json.dumps({"messages": USER, "n": 9}), "n", "n: 9 is above"),
]


def test_bad_inputs_get_400_naming_the_field_while_good_requests_succeed(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            good = [
                http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 12}) for _ in range(8)
            ]
            bad = [
                http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
                for body, _, _ in BAD
            ]
            too_long = http.post("/v1/completions", json={"prompt": list(range(300)), "max_tokens": 2})
            return await asyncio.gather(*good, *bad, too_long)

    responses = asyncio.run(run())
    assert all(r.status_code == 200 and r.json()["choices"] for r in responses[:8])
    for response, (_, param, text) in zip(responses[8:-1], BAD, strict=True):
        error = response.json()["error"]
        # A prompt over max_model_len carries its named code, as the gateway's refusals do (issue 27).
        code = "max_prompt_length_exceeded" if param == "messages" else 400
        assert response.status_code == 400 and error["code"] == code, response.text
        assert error["type"] == "BadRequestError"
        assert text in error["message"] and error["param"] == param
    assert responses[-1].status_code == 400 and "300 tokens" in responses[-1].json()["error"]["message"]


def test_admin_routes(admin_server, tmp_path, tokenizer, make_diverse_model):
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    engine, handle = admin_server
    client = _client(handle)

    def greedy():
        reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
        return reply.choices[0].message.content, reply.model_extra["policy_version"]

    models = httpx.get(handle.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"] and models[0]["max_model_len"] == 256
    before, version = greedy()
    assert version == 0
    new_state = {k: v.clone() for k, v in make_diverse_model(seed=3).state_dict().items()}
    save_file(new_state, str(tmp_path / "model.safetensors"))
    admin = admin_headers(process_admin_token())  # the token every server of this process requires
    update = httpx.post(
        handle.url + "/update_weights", json={"path": str(tmp_path)}, headers=admin, timeout=60
    )
    update = update.json()
    assert update == {"policy_version": 1, "weights_fingerprint": fingerprint_state_dict(new_state)}
    after, version = greedy()
    assert version == 1 and after != before
    # A missing path, a file that is not safetensors, a folder without one, weights of another model: a JSON
    # 400 naming the path, never a 500.
    (tmp_path / "notes.txt").write_text("not a safetensors file")
    (tmp_path / "empty").mkdir()
    save_file({"no.such.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    for name in ("nope", "notes.txt", "empty", "other.safetensors"):
        path = str(tmp_path / name)
        bad = httpx.post(handle.url + "/update_weights", json={"path": path}, headers=admin)
        error = bad.json()["error"]
        assert bad.status_code == 400 and error["param"] == "path" and path in error["message"], bad.text
        assert error["type"] == "BadRequestError"
    assert "no.such.weight" in error["message"] and greedy() == (after, 1)  # refused whole, nothing written

    peft_model = get_peft_model(
        copy.deepcopy(engine.model),
        LoraConfig(r=4, target_modules=["q_proj", "o_proj"], init_lora_weights=False),
    )
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    loaded = httpx.post(
        handle.url + "/v1/load_lora_adapter",
        json={"lora_name": "mine", "lora_path": str(tmp_path / "adapter")},
        headers=admin,
        timeout=60,
    )
    assert loaded.status_code == 200 and loaded.json()["policy_version"] == 2
    assert greedy()[0] != after
    assert [m["id"] for m in httpx.get(handle.url + "/v1/models").json()["data"]] == ["tiny", "mine"]
    assert client.completions.create(model="mine", prompt="Hi", max_tokens=2).choices  # the adapter's name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="theirs", prompt="Hi", max_tokens=2)

    assert httpx.post(handle.url + "/sleep", headers=admin).json() == {"is_sleeping": True}
    assert httpx.get(handle.url + "/is_sleeping").json() == {"is_sleeping": True}
    assert httpx.post(handle.url + "/wake_up", headers=admin).json() == {"is_sleeping": False}
    metrics = httpx.get(handle.url + "/stats").json()
    assert (
        metrics["policy_version"] == 2
        and metrics["lora_adapter"] == "mine"
        and metrics["tokens_generated"] > 0
    )
    assert metrics["weights_fingerprint"] == engine.weights_fingerprint()
