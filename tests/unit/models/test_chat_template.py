"""The chat template renders the exact Qwen2.5 / Hermes strings (checked character by character)."""

import pytest
from transformers import AutoTokenizer

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
CALC_JSON = (
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate.", '
    '"parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}'
)
TOOLS_TAIL = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + CALC_JSON
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


@pytest.fixture(scope="module")
def tok(mini_path):
    return AutoTokenizer.from_pretrained(mini_path)


def render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def test_system_user_assistant(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
    ]
    assert render(tok, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
    )


def test_generation_prompt_and_no_default_system(tok):
    out = render(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tools_without_system(tok):
    out = render(tok, [{"role": "user", "content": "hi"}], tools=[CALC])
    assert out == "<|im_start|>system\n" + TOOLS_TAIL + "<|im_start|>user\nhi<|im_end|>\n"


def test_tools_with_system(tok):
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "hi"}]
    out = render(tok, messages, tools=[CALC])
    assert out == "<|im_start|>system\nUse tools.\n\n" + TOOLS_TAIL + "<|im_start|>user\nhi<|im_end|>\n"


def test_tool_calls_and_grouped_tool_responses(tok):
    messages = [
        {"role": "user", "content": "2+3 and 1+1?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'},
                },
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "1+1"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "5"},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "assistant", "content": "#### 5"},
    ]
    assert render(tok, messages, add_generation_prompt=True) == (
        "<|im_start|>user\n2+3 and 1+1?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n#### 5<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_assistant_content_before_tool_call(tok):
    messages = [
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
        },
    ]
    assert render(tok, messages) == (
        '<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
    )


def test_multimodal_parts(tok):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": " now"},
            ],
        },
    ]
    img = "<|vision_start|><|image_pad|><|vision_end|>"
    assert render(tok, messages) == f"<|im_start|>user\nLook: {img}{img} now<|im_end|>\n"


def test_template_tokenizes_to_special_ids(tok):
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == 1 and ids.count(2) == 1 and ids.count(1) == 2


def test_unknown_role_raises(tok):
    with pytest.raises(Exception, match="unknown message role narrator"):
        render(tok, [{"role": "narrator", "content": "x"}])
