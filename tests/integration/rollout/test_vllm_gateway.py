"""Two real vLLM CPU servers behind the gateway: traces, runtime LoRA, full-weight reload, a killed server.

One module-scoped fixture starts both servers in parallel (20-45 s on 2 cores); the tests share them
and run in file order (the weight reload, then the adapter, then the kill, which ends the servers).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import openai
import pytest
import torch

from agentrl.models import resolve_model_path
from agentrl.rollout.engines._request_metrics import RequestMetrics
from agentrl.rollout.engines.vllm import group_alive, launch_vllm_servers, save_weights_for_vllm
from agentrl.rollout.gateway import Gateway
from agentrl.rollout.pool import RolloutPool
from agentrl.rollout.prometheus import render_prometheus
from agentrl.types import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL = "tiny:qwen2"  # head_dim 32: vLLM's CPU attention supports 32, 64, ... (not qwen2-mini's 16)
PROMPT_IDS = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON} missing: build the vLLM environment with `make setup-vllm`")
    path = resolve_model_path(MODEL)
    logs = tmp_path_factory.mktemp("vllm_logs")
    with launch_vllm_servers(
        path, 2, python=str(VLLM_PYTHON), served_model_name=MODEL, max_model_len=256, dtype="float32",
        max_lora_rank=8, startup_timeout=240, log_dir=logs,
    ) as servers:  # fmt: skip
        pool = RolloutPool(servers, model_name=MODEL, engine="vllm", request_timeout=60, probe_interval=60)
        with Gateway(pool, sampling_train=SamplingParams(temperature=1.0, max_tokens=8), max_n=4) as gateway:
            yield gateway, servers, path
    for server in servers:
        assert not group_alive(server.pgid), f"vLLM server {server.url} left processes behind"


def _greedy(gateway: Gateway, sid: str) -> list[int]:
    client = openai.OpenAI(base_url=gateway.open_session(sid, "validation"), api_key="x", max_retries=0)
    client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=8)
    return gateway.session_traces(sid)[-1].response_ids


def test_concurrent_sessions_are_traced_with_token_ids_and_logprobs(stack) -> None:
    gateway, servers, _ = stack

    async def session(i: int) -> None:
        async with openai.AsyncOpenAI(
            base_url=gateway.open_session(f"c{i}"), api_key="x", max_retries=0
        ) as c:
            msgs = [{"role": "user", "content": f"Count to {i}."}]
            first = await c.chat.completions.create(model=MODEL, messages=msgs)
            msgs += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "More."},
            ]
            stream = await c.chat.completions.create(model=MODEL, messages=msgs, stream=True)
            assert (
                "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices]) is not None
            )
            await c.completions.create(model=MODEL, prompt="1 2 3", n=2)

    async def run() -> None:
        await asyncio.gather(*(session(i) for i in range(6)))

    asyncio.run(run())
    used = set()
    for i in range(6):
        traces = gateway.session_traces(f"c{i}")
        assert [t.choice_index for t in traces] == [0, 0, 0, 1]
        for t in traces:
            assert t.prompt_ids and 1 <= len(t.response_ids) <= 8
            assert len(t.logprobs) == len(t.response_ids) and all(lp <= 0 for lp in t.logprobs)
            assert t.policy_version == 0
        assert len({t.server for t in traces}) == 1  # sticky
        assert traces[1].prompt_ids[: len(traces[0].prompt_ids)] == traces[0].prompt_ids
        used |= {t.server for t in traces}
    assert used == {s.url for s in servers}


SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")
"""What Prometheus appends to a family's name in its samples."""


def _families(text: str) -> dict[str, tuple[str, set[str]]]:
    """Prometheus text -> {sample name: (its family's type, its label names)}."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ")
            types[family] = kind
        elif line and not line.startswith("#"):
            name, _, labels = line.split(" ")[0].partition("{")
            keys = {pair.split("=")[0] for pair in labels.rstrip("}").split(",") if "=" in pair}
            samples[name] = keys
    out = {}
    for name, keys in samples.items():
        family = next(f for f in (name, *(name.removesuffix(s) for s in SUFFIXES)) if f in types)
        out[name] = (types[family], keys)
    return out


def test_every_metric_the_embedded_server_exposes_is_vllms_by_name_type_and_labels(stack) -> None:
    """What an embedded server's `GET /metrics` answers (every vLLM-named sample it renders) against a real vLLM
    server's, after the requests above: each sample name is vLLM's, of the same metric type, with label names
    vLLM's sample has too (vLLM adds its `engine`), so a dashboard's queries for vLLM read both."""
    _, servers, _ = stack
    ours = _families(render_prometheus({"request_metrics": RequestMetrics(256).snapshot()}, MODEL))
    theirs = _families(httpx.get(servers[0].url + "/metrics", timeout=30).text)
    assert len(ours) > 30
    for name, (kind, labels) in ours.items():
        assert name in theirs, f"{name} is not on vLLM's /metrics"
        assert theirs[name][0] == kind, (name, kind, theirs[name][0])
        assert labels - {"le"} <= theirs[name][1], (name, labels, theirs[name][1])


def test_tools_request_is_accepted(stack) -> None:
    gateway, _, _ = stack
    client = openai.OpenAI(base_url=gateway.open_session("tools"), api_key="x", max_retries=0)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+3?"}], tools=tools)
    assert len(gateway.session_traces("tools")) == 1


def test_min_tokens_and_ignore_eos_reach_vllm_under_its_names(stack) -> None:
    gateway, _, _ = stack

    def greedy(sid: str, **extra) -> tuple[list[int], str]:
        client = openai.OpenAI(base_url=gateway.open_session(sid, "validation"), api_key="x", max_retries=0)
        body = {"ignore_eos": True, **extra}  # EOS never cuts an answer short here; stop tokens still do
        reply = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=8, extra_body=body)
        (trace,) = gateway.session_traces(sid)
        return trace.response_ids, reply.choices[0].finish_reason

    reference, finish = greedy("ext-ref")
    assert (len(reference), finish) == (8, "length")
    stop = reference[0]  # the greedy answer's first token, made a stop token
    assert greedy("ext-stop", stop_token_ids=[stop]) == ([stop], "stop")
    # vLLM masks stop tokens below min_tokens: the token cannot appear there, and the answer is longer.
    ids, _ = greedy("ext-min", stop_token_ids=[stop], min_tokens=3)
    assert len(ids) >= 3 and stop not in ids[:3]
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        greedy("ext-bad", min_tokens=9)


def test_prompts_over_the_limit_get_the_gateways_code_from_vllm_too(stack) -> None:
    """vLLM's own context-length 400 (max_model_len 256) and a prompt within it but over the gateway's
    data.max_prompt_length (64) are both a 400 with code max_prompt_length_exceeded; no trace is kept."""
    _, servers, _ = stack
    pool = RolloutPool(servers, model_name=MODEL, engine="vllm", request_timeout=60, probe_interval=60)
    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    with Gateway(pool, sampling_train=sampling, max_prompt_tokens=64) as gateway:
        for sid, call in (
            ("long-chat", lambda c: c.chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": "many words " * 300}])),
            ("long-ids", lambda c: c.completions.create(model=MODEL, prompt=list(range(5, 305)))),
            ("over-64", lambda c: c.completions.create(model=MODEL, prompt=list(range(5, 105)))),
        ):  # fmt: skip
            client = openai.OpenAI(base_url=gateway.open_session(sid), api_key="x", max_retries=0)
            with pytest.raises(openai.BadRequestError) as info:
                call(client)
            assert info.value.code == "max_prompt_length_exceeded", info.value.body
            assert gateway.session_traces(sid) == [] and gateway.refused_prompts(sid) == 1
        client = openai.OpenAI(base_url=gateway.open_session("fits"), api_key="x", max_retries=0)
        client.completions.create(model=MODEL, prompt=PROMPT_IDS)
        assert len(gateway.session_traces("fits")) == 1


def test_full_weight_reload_serves_the_new_weights(stack, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    gateway, _, _ = stack
    new = AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL + "@1"), dtype=torch.float32)
    expected = new.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=8, do_sample=False)[0, 4:].tolist()
    before = [_greedy(gateway, f"before{i}") for i in range(2)]
    assert before[0] != expected

    folder = save_weights_for_vllm(new.state_dict(), tmp_path / "step1")
    assert asyncio.run(gateway.pool.update_weights(str(folder))) == 1

    # Every server (sessions spread over both) now generates exactly what the new model generates.
    after = [_greedy(gateway, f"after{i}") for i in range(4)]
    servers = {gateway.session_traces(f"after{i}")[0].server for i in range(4)}
    assert len(servers) == 2 and all(ids == expected for ids in after)
    assert all(gateway.session_traces(f"after{i}")[0].policy_version == 1 for i in range(4))


def test_lora_adapter_loaded_at_run_time_changes_the_output(stack, tmp_path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    gateway, _, _ = stack
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL + "@1"), dtype=torch.float32)
    peft_model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.5)
    peft_model.save_pretrained(tmp_path / "adapter")
    expected = peft_model.generate(input_ids=torch.tensor([PROMPT_IDS]), max_new_tokens=8, do_sample=False)[
        0, 4:
    ]

    before = _greedy(gateway, "lora-before")
    assert asyncio.run(gateway.pool.load_lora_adapter("policy", str(tmp_path / "adapter"))) == 2
    after = _greedy(gateway, "lora-after")
    assert after != before
    assert after == expected.tolist()
    assert gateway.session_traces("lora-after")[0].policy_version == 2


def test_killing_a_vllm_server_mid_run_leaves_every_request_answered(stack) -> None:
    gateway, servers, _ = stack
    victim = servers[0]

    async def one(i: int) -> int:
        async with openai.AsyncOpenAI(
            base_url=gateway.open_session(f"k{i}"), api_key="x", max_retries=0
        ) as c:
            await c.completions.create(model=MODEL, prompt=f"{i} apples", max_tokens=8)
        return len(gateway.session_traces(f"k{i}"))

    async def run() -> list[int]:
        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        while gateway.pool.servers[0].in_flight == 0:
            await asyncio.sleep(0.005)
        os.killpg(victim.pgid, signal.SIGKILL)
        return await asyncio.gather(*tasks)

    assert asyncio.run(run()) == [1] * 8
    state = gateway.pool.servers[0]
    assert not state.healthy and state.failures >= 1
    assert {gateway.session_traces(f"k{i}")[0].server for i in range(8)} <= {s.url for s in servers}
