"""A real embedded server on loopback: vLLM's sampling extensions and refused requests (admin tokens:
test_admin_routes.py).

EOS is made observable by declaring a token the greedy answer contains to be the model's EOS
(`generation_config.eos_token_id`), so each case has an exact expected token list.
"""

from __future__ import annotations

import copy

import httpx
import openai
import pytest
import torch

from agentrl.rollout.app import build_server_app
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.rollout.gateway import Gateway
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.uvicorn_thread import start_server_in_thread
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow
PROMPT = [10, 11, 12, 13]
N = 12


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def eos_case(model, tokenizer):
    """A server whose EOS is a token of the greedy answer at position >= 2 (its first occurrence)."""
    reference = _greedy(model, PROMPT, N)
    eos_at = next(i for i in range(2, N) if reference[i] not in reference[:i])
    served = copy.deepcopy(model)
    served.generation_config.eos_token_id = reference[eos_at]
    engine = EmbeddedEngine(served, tokenizer, max_num_seqs=8, max_model_len=128)
    handle = start_server_in_thread(build_server_app(engine, tokenizer, model_name="tiny"))
    yield handle, reference, eos_at
    handle.stop()
    engine.close()


def _complete(base_url: str, **extra) -> tuple[list[int], str]:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    reply = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=N,
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )
    return reply.choices[0].model_extra["token_ids"], reply.choices[0].finish_reason


def test_ignore_eos_and_min_tokens_on_the_embedded_server(eos_case):
    handle, reference, eos_at = eos_case
    assert _complete(handle.url + "/v1") == (reference[: eos_at + 1], "stop")
    assert _complete(handle.url + "/v1", ignore_eos=True) == (reference, "length")
    # min_tokens past the EOS: as in vLLM the EOS cannot be drawn there, so greedy takes the next-best token
    # and goes on; the answer ends at a later EOS or the length limit.
    tokens, finish = _complete(handle.url + "/v1", min_tokens=eos_at + 2)
    eos = reference[eos_at]
    assert tokens[:eos_at] == reference[:eos_at] and tokens[eos_at] != eos
    assert eos not in tokens[: eos_at + 2]  # the first eos_at + 2 tokens
    assert (finish, tokens[-1]) == ("stop", eos) if finish == "stop" else len(tokens) == N
    # vLLM's rule: min_tokens tokens come before an EOS can be drawn, so min_tokens=eos_at still allows it.
    assert _complete(handle.url + "/v1", min_tokens=eos_at) == (reference[: eos_at + 1], "stop")
    assert _complete(handle.url + "/v1", min_tokens=eos_at + 1)[0][eos_at] != reference[eos_at]
    r = httpx.post(handle.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "min_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = httpx.post(handle.url + "/v1/completions", json={"prompt": PROMPT, "min_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_the_gateway_passes_the_extensions_through(eos_case):
    handle, reference, eos_at = eos_case
    pool = RolloutPool([handle.url], model_name="tiny")
    with Gateway(pool, sampling_train=SamplingParams(temperature=0.0, max_tokens=N)) as gateway:
        assert _complete(gateway.open_session("a"))[0] == reference[: eos_at + 1]
        assert _complete(gateway.open_session("b"), ignore_eos=True) == (reference, "length")
        (trace,) = gateway.session_traces("b")
        assert trace.response_ids == reference and trace.finish_reason == "length"


def test_requests_the_server_refuses_name_the_field(server_url):
    chat = server_url + "/v1/chat/completions"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = httpx.post(
        chat, json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.1"
    assert "text-only" in r.json()["error"]["message"]
    r = httpx.post(chat, json={"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["type"] == "NotFoundError"
    messages = [{"role": "user", "content": "2+3?"}, {"role": "tool", "content": "5"}]
    r = httpx.post(chat, json={"model": "tiny", "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.tool_call_id"
    # The same request with the call's id, and a plain text part list, are served.
    messages[1]["tool_call_id"] = "call_1"
    assert httpx.post(chat, json={"model": "tiny", "messages": messages, "max_tokens": 2}).status_code == 200
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert httpx.post(chat, json={"messages": text_parts, "max_tokens": 2}).status_code == 200


def test_long_prompts_top_logprobs_and_logit_bias_are_refused_as_vllm_refuses_them(server_url, model):
    """A prompt over `agentrl_max_prompt_tokens` (the gateway's data.max_prompt_length) or over max_model_len is
    a 400 with code max_prompt_length_exceeded before anything is generated; `top_logprobs` without `logprobs`
    and `logit_bias` ids outside the vocabulary are 400s naming the field; `type` is vLLM's BadRequestError."""
    chat, completions = server_url + "/v1/chat/completions", server_url + "/v1/completions"
    user = [{"role": "user", "content": "2+3?"}]
    refusals = [
        (chat, {"messages": user, "agentrl_max_prompt_tokens": 3}, "messages", "more than the 3 allowed"),
        (
            completions,
            {"prompt": PROMPT, "agentrl_max_prompt_tokens": 3},
            "prompt",
            "more than the 3 allowed",
        ),
        (completions, {"prompt": list(range(200))}, "prompt", "max_model_len is 128"),
    ]
    for url, body, param, text in refusals:
        r = httpx.post(url, json={**body, "max_tokens": 2})
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "max_prompt_length_exceeded", r.text
        assert (error["type"], error["param"]) == ("BadRequestError", param) and text in error["message"]
    assert httpx.post(
        chat, json={"messages": user, "max_tokens": 2, "agentrl_max_prompt_tokens": 100}
    ).is_success

    r = httpx.post(chat, json={"messages": user, "max_tokens": 2, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert "set logprobs to true" in r.json()["error"]["message"]
    r = httpx.post(chat, json={"messages": user, "max_tokens": 2, "top_logprobs": 2, "logprobs": True})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2

    vocab = model.get_input_embeddings().weight.shape[0]
    for url, body in ((chat, {"messages": user}), (completions, {"prompt": PROMPT})):
        for bias, text in (
            ({str(vocab): 5.0}, f"outside the vocabulary [0, {vocab})"),
            ({"x": 1}, "'x' is not"),
        ):
            r = httpx.post(url, json={**body, "max_tokens": 2, "logit_bias": bias})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == "logit_bias" and text in error["message"], (
                r.text
            )
        assert httpx.post(url, json={**body, "max_tokens": 2, "logit_bias": {str(vocab - 1): 1.0}}).is_success


@pytest.fixture(scope="module")
def server_url(model, tokenizer):
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=8, max_model_len=128)
    handle = start_server_in_thread(build_server_app(engine, tokenizer, model_name="tiny"))
    yield handle.url
    handle.stop()
    engine.close()
