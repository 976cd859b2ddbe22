"""The engine's stop check: EOS, stop tokens and stop strings, and vLLM's `ignore_eos` / `min_tokens`.

Tokens are appended by hand (what the engine does after each sampling step), with the tiny preset's
real tokenizer, so every case is exact.
"""

import asyncio

import pytest

from agentrl.models import load_tokenizer
from agentrl.rollout.engines._requests import Detokenizer, Request, Sequence
from agentrl.types import SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny:qwen2-mini")


def _run(tokenizer, tokens: list[int], max_tokens: int = 16, **params) -> tuple[Sequence, Detokenizer]:
    """Feed `tokens` one by one until the check says finished; returns the sequence."""
    loop = asyncio.new_event_loop()
    sampling = SamplingParams(max_tokens=max_tokens, **params)
    request = Request([1, 2, 3], sampling, 0, max_tokens, loop, asyncio.Queue())
    seq = Sequence(request=request, index=0, seed=0)
    detok = Detokenizer(tokenizer, {EOS})
    for token in tokens:
        seq.token_ids.append(token)
        detok.check_finished(seq, max_model_len_reached=False)
        if seq.finish_reason:
            break
    loop.close()
    return seq, detok


def test_eos_ends_the_sequence_and_ignore_eos_keeps_going(tokenizer):
    seq, _ = _run(tokenizer, [277, EOS, 86, 788])
    assert (seq.token_ids, seq.finish_reason) == ([277, EOS], "stop")
    seq, detok = _run(tokenizer, [277, EOS, 86, 788], max_tokens=4, ignore_eos=True)
    assert (seq.token_ids, seq.finish_reason) == ([277, EOS, 86, 788], "length")
    assert "<|im_end|>" not in detok.build_output(seq).text  # EOS stays out of the text
    # Explicit stop token ids still stop under ignore_eos, as in vLLM.
    seq, _ = _run(tokenizer, [277, EOS, 86, 788], ignore_eos=True, stop_token_ids=[86])
    assert (seq.token_ids, seq.finish_reason) == ([277, EOS, 86], "stop")


def test_eos_and_stop_tokens_stay_out_of_the_text_even_when_the_tokenizer_does_not_mark_them_special(
    tokenizer,
):
    """A converted tokenizer may leave its chat EOS unmarked (SmolLM2's `<|im_end|>` under transformers 5.17): the
    engine stopped on it and its text reached the grader, so no answer was ever strictly right."""
    ordinary_eos, stop = 788, 86
    assert ordinary_eos not in tokenizer.all_special_ids and stop not in tokenizer.all_special_ids
    loop = asyncio.new_event_loop()
    detok = Detokenizer(tokenizer, {ordinary_eos})
    for params, tokens in (
        (SamplingParams(max_tokens=8), [277, ordinary_eos]),
        (SamplingParams(max_tokens=8, stop_token_ids=[stop]), [277, stop]),
    ):
        seq = Sequence(request=Request([1], params, 0, 8, loop, asyncio.Queue()), index=0, seed=0)
        for token in tokens:
            seq.token_ids.append(token)
            detok.check_finished(seq, max_model_len_reached=False)
        out = detok.build_output(seq)
        assert (out.finish_reason, out.token_ids) == ("stop", tokens)  # kept for training
        assert out.text == tokenizer.decode([277])
    loop.close()


def test_min_tokens_defers_eos_and_stop_tokens(tokenizer):
    seq, _ = _run(tokenizer, [277, EOS, 86, EOS, 788], min_tokens=3)
    assert (seq.token_ids, seq.finish_reason) == ([277, EOS, 86, EOS], "stop")  # 2nd EOS is token 4
    seq, _ = _run(tokenizer, [277, 86, 788, 1412], min_tokens=3, stop_token_ids=[86])
    assert seq.finish_reason is None  # 86 came as token 2 < min_tokens, and never again
    seq, _ = _run(tokenizer, [277, EOS, 86], min_tokens=2)
    assert (seq.token_ids, seq.finish_reason) == ([277, EOS], "stop")  # the min_tokens-th token may end it


def test_min_tokens_ignores_stop_strings_in_its_first_tokens(tokenizer):
    ids = tokenizer("ab ab ab ab")["input_ids"]  # 'ab', ' a', 'b', ' a', 'b', ...
    seq, detok = _run(tokenizer, ids, stop=["ab"])
    assert (len(seq.token_ids), detok.build_output(seq).text) == (1, "")
    # The first "ab" lies within min_tokens=2: it does not count, now or later; the next one stops.
    seq, detok = _run(tokenizer, ids, stop=["ab"], min_tokens=2)
    assert (seq.token_ids, seq.finish_reason) == (ids[:3], "stop")
    assert detok.build_output(seq).text == "ab "


def test_length_still_ends_a_sequence_below_min_tokens(tokenizer):
    seq, _ = _run(tokenizer, [277, 86, 788, 1412], max_tokens=2, min_tokens=2)
    assert (seq.token_ids, seq.finish_reason) == ([277, 86], "length")


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
