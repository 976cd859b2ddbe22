"""Chat rendering through the tiny preset's template, and Hermes/Qwen tool-call parsing."""

import json

import pytest

from agentrl.models import load_tokenizer
from agentrl.rollout.chat import (
    ChatRenderCache,
    decode_completion,
    find_hidden_token_ids,
    parse_tool_calls,
    render_chat,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny:qwen2-mini")


def test_parse_plain_text_has_no_tool_calls():
    parsed = parse_tool_calls("The answer is 4.")
    assert parsed.content == "The answer is 4." and parsed.tool_calls == [] and parsed.error is None


def test_parse_two_tool_calls_with_surrounding_text():
    text = (
        'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.error is None and parsed.content == "Let me check."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["add", "now"]
    first = parsed.tool_calls[0]
    assert first["type"] == "function" and first["id"].startswith("call_") and len(first["id"]) == 29
    assert json.loads(first["function"]["arguments"]) == {"a": 1, "b": 2}
    assert parsed.tool_calls[1]["function"]["arguments"] == "{}"


def test_parse_only_a_tool_call_gives_null_content():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert parsed.content is None
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"x": 1}'


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>{"name": "f", "arguments": {</tool_call>', "tool call 0: Expecting"),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            'tool call 0: a tool call must be a JSON object with a string "name"',
        ),
        ('<tool_call>{"name": "f"}', "without a closing </tool_call>"),
        ('<tool_call>{"name": "f"}</tool_call><tool_call>[1]</tool_call>', "tool call 1"),
    ],
)
def test_parse_invalid_tool_call_stays_content_and_is_flagged(text, error):
    parsed = parse_tool_calls(text)
    assert parsed.content == text and parsed.tool_calls == []
    assert parsed.error is not None and error in parsed.error


def test_render_plain_chat(tokenizer):
    ids = render_chat(
        tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_tool_round_trip_as_agent_frameworks_send_it(tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "1+2?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    text = tokenizer.decode(render_chat(tokenizer, messages, tools=tools))
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools")
    assert '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}' in text
    assert text.endswith(
        "<|im_start|>user\n1+2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_error_names_messages(tokenizer):
    with pytest.raises(ValueError, match="messages: the chat template"):
        render_chat(tokenizer, [{"role": "narrator", "content": "x"}])


def test_completion_text_keeps_tool_markers_and_drops_control_tokens(tokenizer):
    hidden = find_hidden_token_ids(tokenizer)
    ids = tokenizer.encode('<tool_call>{"name": "f"}</tool_call><|im_end|>')
    assert tokenizer.eos_token_id in hidden
    assert decode_completion(tokenizer, ids, hidden) == '<tool_call>{"name": "f"}</tool_call>'


def test_render_cache_gives_render_chats_ids_and_evicts_the_oldest(tokenizer):
    """Same messages -> a hit with the same ids (a fresh list); other tools or messages -> a miss; at
    `size` entries the least recently used conversation goes."""
    cache = ChatRenderCache(tokenizer, size=2)
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    first = cache.render(question)
    assert first == render_chat(tokenizer, question) and cache.hits == 0
    again = cache.render([dict(m) for m in question])
    assert again == first and again is not first and cache.hits == 1
    again.append(0)  # the caller owns its list
    assert cache.render(question) == first and cache.hits == 2
    with_tools = cache.render(question, tools=tools)
    assert with_tools == render_chat(tokenizer, question, tools=tools) != first and cache.hits == 2
    assert cache.render(question) == first and cache.hits == 3  # `question` is now the most recent...
    cache.render([{"role": "user", "content": "What is 4 + 4?"}])  # ...so a third entry evicts the tools one
    assert cache.render(question) == first and cache.hits == 4
    cache.render(question, tools=tools)
    assert cache.hits == 4
