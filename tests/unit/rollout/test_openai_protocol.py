"""Request models -> SamplingParams, error formatting, logprob shapes."""

import pytest
from pydantic import ValidationError

from agentrl.rollout._openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    build_chat_logprobs,
    build_completion_logprobs,
    build_error,
    format_validation_error,
    logit_bias_error,
)


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return {1: "a", 2: "bc", 3: "é"}[ids[0]]


def test_chat_request_defaults_and_mapping():
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], stop="##", top_k=0, seed=3, user="ignored-extra-field"
    )
    params = req.to_sampling_params(max_tokens=7)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, -1, 7)
    assert params.stop == ["##"] and params.seed == 3 and params.n == 1


def test_wrong_types_are_named_by_dotted_path():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=[{"role": "user", "content": 5}], n="many")
    message, param = format_validation_error([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])
    assert "n: Input should be a valid integer" in message
    assert "messages.0.content" in message
    assert param in ("n", "messages.0.content.str")


def test_invalid_json_message():
    message, param = format_validation_error(
        [
            {
                "type": "json_invalid",
                "loc": ("body", 1),
                "msg": "JSON decode error",
                "ctx": {"error": "Expecting value"},
            }
        ]
    )
    assert message == "invalid JSON body: Expecting value" and param is None


def test_completion_prompt_forms():
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1], [2, 3]]):
        assert CompletionRequest(prompt=prompt).prompt == prompt
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=[1.5])


def test_error_body_shape():
    assert build_error("bad n", "n") == {
        "error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}
    }


def test_logprob_shapes():
    from agentrl.rollout._openai_protocol import TokenText

    text = TokenText(_Tok())
    chat = build_chat_logprobs(text, [1, 3], [-0.5, -1.0], [{1: -0.5, 2: -2.0}, {3: -1.0}])
    assert chat["content"][0] == {
        "token": "a",
        "logprob": -0.5,
        "bytes": [97],
        "top_logprobs": [
            {"token": "a", "logprob": -0.5, "bytes": [97]},
            {"token": "bc", "logprob": -2.0, "bytes": [98, 99]},
        ],
    }
    assert chat["content"][1]["bytes"] == [195, 169]
    legacy = build_completion_logprobs(text, [2, 1], [-0.1, -0.2], None, text_offset=4)
    assert legacy == {
        "tokens": ["bc", "a"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [None, None],
        "text_offset": [4, 6],
    }


def test_logit_bias_names_ids_outside_the_vocabulary_and_biases_that_are_not_numbers():
    assert logit_bias_error({"0": 1.0, "9": -100.0}, 10) is None
    assert "outside the vocabulary [0, 10)" in logit_bias_error({"10": 1.0}, 10)
    assert "is not a token id" in logit_bias_error({"x": 1.0}, 10)
    assert "must be a finite number" in logit_bias_error({"3": float("nan")}, 10)
    assert "must be a finite number" in logit_bias_error({"3": float("-inf")}, 10)
