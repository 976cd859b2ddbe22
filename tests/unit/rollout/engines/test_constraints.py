"""Constrained decoding's grammars (llguidance) against the tiny preset's real tokenizer and template.

The strongest check is the round trip with the chat template: the tokens the template renders for an
assistant tool call (after the generation prompt) must be exactly a sentence of the forced-call grammar,
so a forced call trains on the format the policy sees in its own prompts.
"""

import json

import pytest

from agentrl.models import load_tokenizer
from agentrl.rollout.chat import render_chat
from agentrl.rollout.engines.constraints import (
    ConstraintError,
    GrammarCompiler,
    advance,
    build_constraint,
    fill_bitmasks,
)

EOS = 2
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Lima"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "days"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny:qwen2")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, 2048, {EOS})


def _assistant_tokens(tokenizer, calls: list[tuple[str, dict]]) -> list[int]:
    """What the template renders for an assistant turn holding `calls`, after the generation prompt."""
    user = [{"role": "user", "content": "hi"}]
    prompt = render_chat(tokenizer, user, tools=[WEATHER, ADD])
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)
        ],
    }
    full = render_chat(tokenizer, [*user, message], tools=[WEATHER, ADD], add_generation_prompt=False)
    assert full[: len(prompt)] == prompt
    rest = full[len(prompt) :]
    return rest[: rest.index(EOS) + 1]  # the turn ends with <|im_end|>, then the template's newline


def _accepts(compiler, constraint, tokens: list[int]) -> bool:
    (matcher,) = compiler.start(constraint, 1)
    reasons = []
    for token in tokens:
        mask = fill_bitmasks([matcher], 2048)[0]
        if not (int(mask[token // 32]) >> (token % 32)) & 1:
            return False
        reasons.append(advance(matcher, token, {EOS}))
    return reasons[-1] == "stop" and all(r is None for r in reasons[:-1])


def test_a_forced_call_is_exactly_the_templates_rendering(tokenizer, compiler):
    named = build_constraint([WEATHER, ADD], {"type": "function", "function": {"name": "get_weather"}}, None)
    call = _assistant_tokens(tokenizer, [("get_weather", {"city": "Lima", "days": 3})])
    assert _accepts(compiler, named, call)
    assert not _accepts(compiler, named, _assistant_tokens(tokenizer, [("add", {"a": 1})]))  # other tool
    bad_enum = _assistant_tokens(tokenizer, [("get_weather", {"city": "Rome", "days": 3})])
    assert not _accepts(compiler, named, bad_enum)
    spaced = tokenizer(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Lima", "days": 3}}\n</tool_call>'
    )
    assert not _accepts(compiler, named, spaced["input_ids"] + [EOS])  # only the template's separators


def test_required_takes_any_tool_and_parallel_calls_unless_turned_off(tokenizer, compiler):
    two = _assistant_tokens(tokenizer, [("add", {"a": 1}), ("get_weather", {"city": "Paris", "days": 1})])
    assert _accepts(compiler, build_constraint([WEATHER, ADD], "required", None), two)
    single = build_constraint([WEATHER, ADD], "required", None, parallel_tool_calls=False)
    assert not _accepts(compiler, single, two)
    assert _accepts(compiler, single, _assistant_tokens(tokenizer, [("add", {"a": -7})]))


def test_arguments_get_no_unlisted_properties_unless_the_schema_allows_them(tokenizer, compiler):
    extra = _assistant_tokens(tokenizer, [("add", {"a": 1, "z": 2})])
    assert not _accepts(compiler, build_constraint([ADD], "required", None), extra)
    open_add = {"type": "function", "function": {**ADD["function"], "parameters": {
        **ADD["function"]["parameters"], "additionalProperties": True}}}  # fmt: skip
    assert _accepts(compiler, build_constraint([open_add], "required", None), extra)


def test_response_format_json_schema_and_json_object(tokenizer, compiler):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    constraint = build_constraint(None, None, fmt)
    assert _accepts(compiler, constraint, tokenizer('{"ok": true}')["input_ids"] + [EOS])
    assert not _accepts(compiler, constraint, tokenizer('{"ok": 1}')["input_ids"] + [EOS])
    json_object = build_constraint(None, "auto", {"type": "json_object"})
    assert _accepts(compiler, json_object, tokenizer('{"x": [1, "y"]}')["input_ids"] + [EOS])
    assert not _accepts(compiler, json_object, tokenizer("[1]")["input_ids"] + [EOS])


def test_what_is_not_constrained_and_what_is_refused():
    assert build_constraint([WEATHER], "auto", None) is None
    assert build_constraint([WEATHER], "none", {"type": "text"}) is None
    assert build_constraint(None, None, None) is None
    forced = build_constraint([WEATHER], "required", {"type": "json_object"})
    assert forced.kind == "tool_call"  # the call wins over the response format
    cases = [
        (([WEATHER], {"type": "function", "function": {"name": "nope"}}, None), "tool_choice"),
        ((None, "required", None), "tool_choice"),
        (([WEATHER], None, {"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
        (([WEATHER], None, {"type": "yaml"}), "response_format"),
        (([{"function": {"name": "bad name!"}}], "required", None), "tools.0.function.name"),
    ]
    for args, param in cases:
        with pytest.raises(ConstraintError) as info:
            build_constraint(*args)
        assert info.value.param == param, args


def test_compiled_grammars_are_cached_and_bad_schemas_name_the_field(compiler):
    constraint = build_constraint([WEATHER], "required", None)
    first = compiler.start(constraint, 2)
    assert len(first) == 2 and first[0] is not first[1]
    assert len(compiler._compiled) >= 1 and constraint in compiler._compiled
    bad = build_constraint(
        None, None, {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}
    )
    with pytest.raises(ConstraintError) as info:
        compiler.start(bad, 1)
    assert info.value.param == "response_format"
