"""Several decode steps per engine step (`num_scheduler_steps`, vLLM's multi-step scheduling): the same draws as
one step at a time, rows that end inside an engine step, and what they leave in the cache for the next turn."""

import asyncio
import copy

import pytest

from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.types import SamplingParams
from tests._teacher_forcing import teacher_forcing_gap

pytestmark = pytest.mark.slow


def _serve(model, tokenizer, steps, calls, max_model_len=128):
    """Run `calls` ((prompt, params) pairs) at once through an engine of `steps` scheduler steps; the
    outputs, per call, and the engine's stats after them."""
    engine = EmbeddedEngine(
        copy.deepcopy(model),
        tokenizer,
        max_num_seqs=16,
        max_model_len=max_model_len,
        num_scheduler_steps=steps,
    )

    async def run():
        return await asyncio.gather(*(engine.generate(prompt, params) for prompt, params in calls))

    try:
        return asyncio.run(run()), engine.stats()
    finally:
        engine.close()


def test_several_steps_per_engine_step_draw_what_one_step_at_a_time_draws(model, tokenizer, prompts):
    """Answers of 5-14 tokens (n=3) end inside an engine step of 4; answers of 200 run into max_model_len at
    111-118 tokens, inside one too, and cross 64-position boundaries of the attention's span within one (a
    stale span read one key short: 1e-3 off at the crossing)."""
    calls = [
        (p, SamplingParams(temperature=1.0, max_tokens=5 + 3 * i, n=3, seed=i)) for i, p in enumerate(prompts)
    ]
    calls += [
        (p, SamplingParams(temperature=1.0, max_tokens=200, seed=10 + i)) for i, p in enumerate(prompts)
    ]
    one, one_stats = _serve(model, tokenizer, 1, calls)
    four, four_stats = _serve(model, tokenizer, 4, calls)
    lengths = [len(out.token_ids) for outputs in four for out in outputs]
    assert lengths[:12] == [5] * 3 + [8] * 3 + [11] * 3 + [14] * 3
    assert [len(p) + n for p, n in zip(prompts, lengths[12:], strict=True)] == [128] * 4  # max_model_len
    assert sum((n - 1) % 4 != 0 for n in lengths[12:]) >= 2  # after the first draw, steps come in fours
    for (prompt, _), singles, multis in zip(calls, one, four, strict=True):
        for single, multi in zip(singles, multis, strict=True):
            assert multi.token_ids == single.token_ids
            assert multi.finish_reason == single.finish_reason == "length"
            assert max(abs(a - b) for a, b in zip(multi.logprobs, single.logprobs, strict=True)) < 1e-6
            assert teacher_forcing_gap(model, prompt, multi) < 1e-4
    assert four_stats["decode_steps_device"] % 4 == 0 and one_stats["decode_steps_device"] % 4 != 0


def test_a_row_stopped_inside_an_engine_step_parks_a_history_its_next_turn_reads_exactly(
    model, tokenizer, prompts
):
    """A stop token ends a row at its third token of an engine step of 4: the steps after it still decode the
    row (its slot gets keys past its end), and the row parks its history. The next turn, sent with those ids,
    reuses the parked prefix and its answer equals teacher forcing: nothing past the end was read."""
    engine = EmbeddedEngine(
        copy.deepcopy(model), tokenizer, max_num_seqs=8, max_model_len=256, num_scheduler_steps=4
    )
    try:
        free = SamplingParams(temperature=1.0, max_tokens=20, seed=3)
        (probe,) = asyncio.run(engine.generate(prompts[1], free))
        stop = probe.token_ids[6]  # the 7th draw: the third of the second engine step
        assert stop not in probe.token_ids[:6]
        stopped = SamplingParams(temperature=1.0, max_tokens=20, seed=3, stop_token_ids=[stop])
        (out,) = asyncio.run(engine.generate(prompts[1], stopped))
        assert out.token_ids == probe.token_ids[:7] and out.finish_reason == "stop"
        suffix = tokenizer("\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        following = prompts[1] + out.token_ids + suffix
        hits = engine.stats()["prefix_cache_hits"]
        (answer,) = asyncio.run(
            engine.generate(following, SamplingParams(temperature=1.0, max_tokens=9, seed=4))
        )
        assert engine.stats()["prefix_cache_hits"] - hits >= len(prompts[1]) + 6
        assert teacher_forcing_gap(model, following, answer) < 1e-4
    finally:
        engine.close()


def test_num_scheduler_steps_below_one_is_refused(model, tokenizer):
    with pytest.raises(ValueError, match="num_scheduler_steps must be >= 1, got 0"):
        EmbeddedEngine(
            copy.deepcopy(model), tokenizer, max_num_seqs=2, max_model_len=64, num_scheduler_steps=0
        )


def test_a_streamed_answer_gets_an_engine_steps_tokens_in_one_event(model, tokenizer, prompts):
    """With 4 decode steps per engine step a streamed row's tokens come four to an event (vLLM's multi-step
    streaming), not one event a token: K times fewer chunks through the server and gateway. The tokens and
    logprobs streamed are the ones a single-step engine draws."""
    params = SamplingParams(temperature=1.0, max_tokens=14, seed=5)
    ((single,),), _ = _serve(model, tokenizer, 1, [(prompts[2], params)])
    engine = EmbeddedEngine(
        copy.deepcopy(model), tokenizer, max_num_seqs=4, max_model_len=128, num_scheduler_steps=4
    )

    async def run():
        return [event async for event in engine.stream(prompts[2], params)]

    try:
        events = asyncio.run(run())
    finally:
        engine.close()
    sizes = [len(event.token_ids) for event in events]
    assert sum(sizes) == 14 and max(sizes) == 4 and sizes.count(4) >= 3, sizes
    assert [t for event in events for t in event.token_ids] == single.token_ids
    streamed = [lp for event in events for lp in event.logprobs]
    assert max(abs(a - b) for a, b in zip(streamed, single.logprobs, strict=True)) < 1e-5
    assert events[-1].finish_reason == "length" and events[-1].output.token_ids == single.token_ids
