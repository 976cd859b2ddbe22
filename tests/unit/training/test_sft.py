"""Supervised warm start: loss mask on the response only, a few steps lower the loss, and the held-out check
(greedy accuracy of the last rows) ends it once it reaches sft.stop_accuracy."""

from __future__ import annotations

import json

import pytest
import torch

from agentrl.config.schema import SFTConfig
from agentrl.data import sample_path
from agentrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from agentrl.training.sft import _pad, build_sft_examples, greedy_match_rate, reference_response, run_sft

MODEL = "tiny:qwen2-mini"


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    with open(sample_path("arithmetic_train")) as f:
        return [json.loads(line) for line in f][:8]


def test_reference_response_prefers_extra_info_response():
    assert (
        reference_response({"extra_info": {"response": "x = 4"}, "reward_model": {"ground_truth": "4"}})
        == "x = 4"
    )
    assert reference_response({"extra_info": {}, "reward_model": {"ground_truth": 7}}) == "7"


def test_build_sft_examples_masks_only_the_response_tokens(tokenizer, rows):
    row = {**rows[0], "extra_info": {"response": "The answer is 1"}}
    [(input_ids, mask, _)] = build_sft_examples(tokenizer, [row])

    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    assert len(input_ids) == len(mask)
    assert tokenizer.decode(input_ids) == prompt + "The answer is 1<|im_end|>"
    masked = [t for t, m in zip(input_ids, mask, strict=True) if m]
    assert tokenizer.decode(masked) == "The answer is 1<|im_end|>"
    first = mask.index(1)
    assert mask == [0] * first + [1] * (len(mask) - first)  # prompt 0s, then response 1s
    assert tokenizer.decode(input_ids[:first]) == prompt


def _mean_loss(model, tokenizer, rows) -> float:
    input_ids, labels, attention = _pad(
        [e[:2] for e in build_sft_examples(tokenizer, rows)], tokenizer.pad_token_id
    )
    with torch.no_grad():
        return model(
            input_ids=input_ids, attention_mask=attention, labels=labels, use_cache=False
        ).loss.item()


def test_a_few_sft_steps_lower_the_loss(model_path, tokenizer, rows):
    torch.manual_seed(0)
    model = load_causal_lm(model_path)
    before = _mean_loss(model, tokenizer, rows)
    metrics = run_sft(
        model,
        tokenizer,
        rows,
        SFTConfig(lr=3e-3, batch_size=4, epochs=10, max_steps=12),
        seed=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    after = _mean_loss(model, tokenizer, rows)

    assert metrics["sft/steps"] == 12  # max_steps stops before the 20 steps of 10 epochs
    assert metrics["sft/final_loss"] < metrics["sft/first_loss"]
    assert after < 0.7 * before, (before, after)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


def test_a_row_with_tools_renders_the_prompt_the_gateway_renders(tokenizer, rows):
    from agentrl.rollout.chat import render_chat

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    row = {**rows[0], "tools": TOOLS, "extra_info": {"response": call}}
    [(with_tools, mask, _)] = build_sft_examples(tokenizer, [row])
    [(without_tools, _, _)] = build_sft_examples(tokenizer, [{**row, "tools": None}])

    first = mask.index(1)
    assert with_tools[:first] == render_chat(tokenizer, row["prompt"], tools=TOOLS)  # what RL will see
    prompt_text = tokenizer.decode(with_tools[:first])
    assert "<tools>" in prompt_text and '"name": "add"' in prompt_text
    assert "<tools>" not in tokenizer.decode(without_tools)
    assert tokenizer.decode(with_tools[first:]) == call + "<|im_end|>"


def test_the_warm_start_shows_a_progress_bar(model_path, tokenizer, rows, capsys, monkeypatch):
    monkeypatch.setenv("AGENTRL_PROGRESS", "1")
    run_sft(
        load_causal_lm(model_path),
        tokenizer,
        rows,
        SFTConfig(lr=1e-3, batch_size=4, epochs=5, max_steps=3),
        seed=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    err = capsys.readouterr().err
    assert "sft: 100%" in err and "3/3" in err and "loss=" in err


def test_image_rows_warm_start_a_vision_language_policy_on_their_pixels():
    """A row with an image trains on the image pads and pixels the engine would serve; the loss falls."""
    from PIL import Image

    model = load_causal_lm("tiny:qwen2-vl")
    tokenizer = load_tokenizer("tiny:qwen2-vl")
    row = {
        "prompt": [{"role": "user", "content": "<image>How many?"}],
        "images": [Image.new("RGB", (56, 56), "red")],
        "reward_model": {"ground_truth": "3"},
    }
    [(ids, mask, images)] = build_sft_examples(tokenizer, [row], image_model=model)
    assert ids.count(model.config.image_token_id) == 4 and images.image_grid_thw.tolist() == [[1, 4, 4]]
    sft = SFTConfig(epochs=20, lr=1e-3, batch_size=1)
    metrics = run_sft(model, tokenizer, [row], sft, seed=0, pad_token_id=tokenizer.pad_token_id)
    assert metrics["sft/final_loss"] < metrics["sft/first_loss"]


def test_greedy_match_rate_is_the_share_that_greedy_decoding_reproduces(model_path, tokenizer, rows):
    """One teacher-forced forward gives the same verdict per row as generating greedily from the prompt."""
    torch.manual_seed(0)
    model = load_causal_lm(model_path)
    run_sft(model, tokenizer, rows, SFTConfig(lr=3e-3, batch_size=4, epochs=30, max_steps=30), seed=1,
            pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    examples = build_sft_examples(tokenizer, rows)
    model.eval()
    reproduced = []
    for ids, mask, _ in examples:
        first = mask.index(1)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids[:first]]), max_new_tokens=len(ids) - first, do_sample=False
            )
        reproduced.append(out[0, first:].tolist() == ids[first:])
    assert 0 < sum(reproduced) < len(rows)  # some rows right, some wrong: the comparison means something
    rate = greedy_match_rate(model, examples, tokenizer.pad_token_id, batch_size=3)
    assert rate == sum(reproduced) / len(rows)
    assert not model.training  # the mode it was in


def test_the_held_out_check_ends_the_warm_start_once_it_reaches_stop_accuracy(model_path, tokenizer, rows):
    """The last val_rows rows are not trained on; here they repeat a training row, so they are learnt early."""
    data = [rows[0]] * 6 + rows[1:4] + [rows[0]] * 2
    sft = SFTConfig(
        lr=3e-3, batch_size=4, epochs=1000, max_steps=200, val_rows=2, val_freq=5, stop_accuracy=1.0
    )
    torch.manual_seed(0)
    metrics = run_sft(
        load_causal_lm(model_path), tokenizer, data, sft, seed=1, pad_token_id=tokenizer.pad_token_id
    )
    assert metrics["sft/val_accuracy"] == 1.0
    assert metrics["sft/steps"] < 200 and metrics["sft/steps"] % 5 == 0

    no_stop = sft.model_copy(update={"stop_accuracy": None, "max_steps": 12})
    metrics = run_sft(load_causal_lm(model_path), tokenizer, data, no_stop, seed=1,
                      pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    assert metrics["sft/steps"] == 12 and "sft/val_accuracy" in metrics  # checked after the last step


def test_held_out_rows_are_not_trained_on(model_path, tokenizer, rows):
    """One epoch of 8 rows with 3 held out is 5 steps of one row each."""
    sft = SFTConfig(lr=1e-3, batch_size=1, epochs=1, val_rows=3, val_freq=100)
    metrics = run_sft(
        load_causal_lm(model_path), tokenizer, rows, sft, seed=1, pad_token_id=tokenizer.pad_token_id
    )
    assert metrics["sft/steps"] == 5 and metrics["sft/rows_on_rank0"] == 5
    assert 0.0 <= metrics["sft/val_accuracy"] <= 1.0


def test_holding_out_every_row_is_refused(model_path, tokenizer, rows):
    with pytest.raises(ValueError, match="sft.val_rows=8 would hold out all 8 SFT rows"):
        run_sft(load_causal_lm(model_path), tokenizer, rows, SFTConfig(val_rows=8), seed=1, pad_token_id=0)
