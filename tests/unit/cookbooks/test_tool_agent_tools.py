"""The tool agent's tools and data (cookbooks/tool_agent): calculator, store, ToolBox errors, rows, SFT turns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from agentrl_tool_agent import TOOL_SCHEMAS, ToolAnswerEvaluator, ToolBox, calculate, extract_answer
from agentrl_tool_agent.prepare_data import SAMPLES, make_rows, sft_rows

from agentrl import Episode, Task
from agentrl.data import load_dataset_rows
from agentrl.models import load_tokenizer, resolve_model_path
from agentrl.rollout.chat import parse_tool_calls, render_chat


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("37 * 23", "851"),
        ("10 - 99", "-89"),
        ("(2 + 3) * 4", "20"),
        ("7 / 2", "3.5"),
        ("8 / 2", "4"),
        ("-3 + 1", "-2"),
    ],
)
def test_calculate(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "2 ** 999999", "x + 1", "", "1 +"])
def test_calculate_refuses_anything_but_arithmetic(expression):
    with pytest.raises(ValueError):
        calculate(expression)


def test_toolbox_errors_name_what_was_wrong():
    box = ToolBox({"plum": "417"})
    assert box.call("kv_get", '{"key": "plum"}') == ("417", True)
    assert box.call("kv_get", '{"key": "fig"}') == (
        "error: kv_get raised LookupError: no key 'fig'; keys: ['plum']",
        False,
    )
    assert box.call("kv_get", "{not json")[0].startswith("error: arguments of kv_get are not valid JSON")
    assert box.call("kv_get", "[1]") == ("error: arguments of kv_get must be a JSON object, got list", False)
    assert box.call("kv_get", '{"name": "plum"}')[0].startswith("error: bad arguments for kv_get:")
    assert box.call("kv_set", {"key": "fig", "value": 3}) == ("ok", True)
    assert box.call("kv_get", '{"key": "fig"}') == ("3", True)
    assert ToolBox().call("kv_get", '{"key": "fig"}')[1] is False  # a new episode starts from its own store


def test_schemas_name_every_tool_and_its_required_arguments():
    box = ToolBox()
    assert [s["function"]["name"] for s in TOOL_SCHEMAS] == sorted(box.tools)
    kv_set = next(s["function"] for s in TOOL_SCHEMAS if s["function"]["name"] == "kv_set")
    assert kv_set["parameters"]["required"] == ["key", "value"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("851", "851"),
        (" 851.\n", "851"),
        ("-89", "-89"),
        ("It is 851.", None),  # the prompt asks for the number only
        ("5 * 5 shirtsRemain look", None),  # a right first digit and sampled garbage is not an answer
        ("no", None),
        (None, None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_evaluator_refuses_a_row_without_ground_truth():
    with pytest.raises(ValueError, match="task t: row has no reward_model.ground_truth"):
        ToolAnswerEvaluator().evaluate(Task(id="t", data={}), Episode(answer="1"))


def test_rows_are_valid_split_cleanly_and_each_needs_its_tool():
    train, test = make_rows(40, 20, seed=3)
    assert len(train) == 40 and len(test) == 20
    train_calc = {r["prompt"][0]["content"] for r in train if r["extra_info"]["kind"] == "calc"}
    assert not train_calc & {r["prompt"][0]["content"] for r in test}
    for row in train + test:
        info = row["extra_info"]
        observation, ok = ToolBox(info.get("store")).call(info["call"]["name"], info["call"]["arguments"])
        assert ok and observation == row["reward_model"]["ground_truth"]


def test_shipped_samples_load_and_match_the_generator():
    train, test = make_rows(180, 200, seed=0)
    assert load_dataset_rows(SAMPLES / "train.jsonl") == json.loads(json.dumps(train))
    assert load_dataset_rows(SAMPLES / "test.jsonl") == json.loads(json.dumps(test))


def test_sft_turns_render_as_the_flow_sends_them_and_targets_parse_as_the_calls():
    """The warm start must see the same prompt tokens the gateway renders from the flow's messages at RL time."""
    tokenizer = load_tokenizer(resolve_model_path("tiny:qwen2"))
    task = make_rows(2, 1, seed=0)[0][0]
    call_row, answer_row = sft_rows([task])
    parsed = parse_tool_calls(call_row["extra_info"]["response"])
    assert parsed.error is None and parsed.content is None
    call = parsed.tool_calls[0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == (
        task["extra_info"]["call"]["name"],
        task["extra_info"]["call"]["arguments"],
    )
    assert answer_row["extra_info"]["response"] == task["reward_model"]["ground_truth"]
    # What ToolAgentFlow sends on the second turn: the parsed call and its tool result.
    flow_messages = [
        *task["prompt"],
        {"role": "assistant", "content": "", "tool_calls": [{**parsed.tool_calls[0], "id": "call_0"}]},
        {"role": "tool", "tool_call_id": "call_0", "content": task["reward_model"]["ground_truth"]},
    ]
    assert render_chat(tokenizer, answer_row["prompt"], tools=answer_row["tools"]) == render_chat(
        tokenizer, flow_messages, tools=TOOL_SCHEMAS
    )
    # And the first turn's prompt plus its target is the start of the second turn's prompt (one merged row).
    first = render_chat(tokenizer, call_row["prompt"], tools=TOOL_SCHEMAS)
    target = tokenizer.encode(call_row["extra_info"]["response"], add_special_tokens=False)
    assert (
        render_chat(tokenizer, flow_messages, tools=TOOL_SCHEMAS)[: len(first) + len(target)]
        == first + target
    )


def test_short_prompt_sft_rows_keep_the_targets_and_drop_only_the_tool_preamble():
    """train.py's first warm-start stage trains the same targets on prompts without the ~300-token preamble."""
    tokenizer = load_tokenizer(resolve_model_path("tiny:qwen2"))
    tasks = make_rows(4, 1, seed=0)[0]
    full, short = sft_rows(tasks), sft_rows(tasks, with_tools=False)
    assert all("tools" not in row for row in short) and all(row["tools"] == TOOL_SCHEMAS for row in full)
    assert [r["extra_info"] for r in short] == [r["extra_info"] for r in full]
    assert [r["prompt"] for r in short] == [r["prompt"] for r in full]
    for s, f in zip(short, full, strict=True):
        short_tokens = render_chat(tokenizer, s["prompt"])
        full_tokens = render_chat(tokenizer, f["prompt"], tools=f["tools"])
        assert 200 < len(full_tokens) - len(short_tokens) < 400
        assert len(short_tokens) < 80
        # The question ends both prompts the same way: only the system preamble differs.
        assert full_tokens[-20:] == short_tokens[-20:]


def test_train_py_refuses_a_negative_short_prompt_stage_before_any_work(tmp_path):
    """A bad `--short-prompt-steps` is named in the error and nothing is trained or written."""
    train = Path(__file__).resolve().parents[3] / "cookbooks" / "tool_agent" / "train.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(train),
            "--short-prompt-steps=-1",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--short-prompt-steps must be 0 or more, got -1" in proc.stderr
    assert not (tmp_path / "run").exists()
