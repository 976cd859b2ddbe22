"""Prefix reuse in the embedded engine: an agent's next turn and a GRPO group's siblings prefill only what is new,
and what comes out is exactly what a teacher-forced forward of the whole sequence gives."""

import asyncio
import copy
import random
import time

import pytest
import torch

from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.types import SamplingParams
from tests._teacher_forcing import teacher_forcing_gap

pytestmark = pytest.mark.slow
SAMPLE = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _engine(model, tokenizer, **kwargs):
    return EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=8, max_model_len=256, **kwargs)


def _prompt(tokenizer, text):
    messages = [
        {"role": "system", "content": "You are a careful assistant. " * 4},
        {"role": "user", "content": text},
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _generate(engine, prompt, params=SAMPLE):
    async def run():
        return (await engine.generate(prompt, params))[0]

    out = asyncio.run(run())
    _wait_for(lambda: engine.stats()["running"] == 0)  # its row retires (and parks) just after the answer
    return out


def _next_turn(tokenizer, prompt, out, text):
    """Previous prompt + the sampled ids (their last is the end of the turn) + a new user message."""
    suffix = tokenizer("\n<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    return prompt + out.token_ids + suffix


def test_a_next_turn_prefills_only_its_new_tokens_and_stays_exact(model, tokenizer):
    engine = _engine(model, tokenizer)
    try:
        first_prompt = _prompt(tokenizer, "What is 2+3?")
        first = _generate(engine, first_prompt)
        before = engine.stats()
        second_prompt = _next_turn(tokenizer, first_prompt, first, "And 4+4?")
        second = _generate(engine, second_prompt)
        after = engine.stats()
        reused = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        computed = after["prefill_tokens"] - before["prefill_tokens"]
        assert reused == len(first_prompt) + len(first.token_ids) - 1  # all but the last sampled token
        assert computed == len(second_prompt) - reused
        assert teacher_forcing_gap(model, second_prompt, second) < 1e-4
    finally:
        engine.close()
    plain = _engine(model, tokenizer, enable_prefix_caching=False)
    try:
        again = _generate(plain, second_prompt)
        assert plain.stats()["prefix_cache_hits"] == 0
        assert again.token_ids == second.token_ids  # same seed, same tokens, with and without reuse
    finally:
        plain.close()


def test_siblings_sent_as_separate_requests_share_one_prefill(model, tokenizer):
    engine = _engine(model, tokenizer)
    prompt = _prompt(tokenizer, "Name a colour.")

    async def run():
        calls = [
            engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=10, seed=s)) for s in range(4)
        ]
        return [outs[0] for outs in await asyncio.gather(*calls)]

    try:
        outs = asyncio.run(run())
        stats = engine.stats()
        assert stats["prefills"] == 1 and stats["prefill_tokens"] == len(prompt)
        assert stats["prefix_cache_hits"] == 3 * len(prompt)
        assert len({tuple(o.token_ids) for o in outs}) > 1
        assert max(teacher_forcing_gap(model, prompt, o) for o in outs) < 1e-4
    finally:
        engine.close()


def test_prompts_arriving_together_compute_their_shared_prefix_once_and_stay_exact(model, tokenizer):
    """Four different questions behind one long system prompt, admitted together with nothing parked: the
    system prompt is computed for the first only, the others copy it and compute their own tails."""
    engine = _engine(model, tokenizer)
    prompts = [_prompt(tokenizer, f"Question {i}: what is {i} + {i}?") for i in range(4)]
    shared = next(n for n in range(len(prompts[0])) if len({tuple(p[: n + 1]) for p in prompts}) > 1)
    assert shared >= 32  # the system prompt and the user turn's opening

    async def run():
        calls = [
            engine.generate(p, SamplingParams(temperature=1.0, max_tokens=8, seed=i))
            for i, p in enumerate(prompts)
        ]
        return [outs[0] for outs in await asyncio.gather(*calls)]

    try:
        outs = asyncio.run(run())
        stats = engine.stats()
        assert stats["prefill_tokens"] == sum(len(p) for p in prompts) - 3 * shared
        assert stats["prefix_cache_hits"] == 3 * shared
        assert max(teacher_forcing_gap(model, p, o) for p, o in zip(prompts, outs, strict=True)) < 1e-4
    finally:
        engine.close()


def test_a_prompt_copies_its_prefix_from_a_row_still_running_and_stays_exact(model, tokenizer):
    """Nothing parked, one row decoding a long answer; a second question behind the same system prompt, admitted
    while that row runs, copies the shared prefix out of the running row's slot and computes only its own tail
    (a served burst over a new prefix arrives over several admissions). Both answers equal teacher forcing."""
    engine = _engine(model, tokenizer)
    prompts = [_prompt(tokenizer, f"Question {i}: what is {i} + {i}?") for i in range(2)]
    shared = next(n for n in range(len(prompts[0])) if prompts[0][n] != prompts[1][n])
    assert shared >= 32

    async def run():
        long = SamplingParams(temperature=1.0, max_tokens=150, ignore_eos=True, seed=1)
        first = asyncio.ensure_future(engine.generate(prompts[0], long))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.001)
        before = engine.stats()
        second = (await engine.generate(prompts[1], SamplingParams(temperature=1.0, max_tokens=8, seed=2)))[0]
        after = engine.stats()
        ran_throughout = not first.done()
        return (await first)[0], second, before, after, ran_throughout

    try:
        first, second, before, after, ran_throughout = asyncio.run(run())
        assert before["parked_sequences"] == 0 and ran_throughout
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == shared
        assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompts[1]) - shared
        assert (
            max(teacher_forcing_gap(model, p, o) for p, o in zip(prompts, (first, second), strict=True))
            < 1e-4
        )
    finally:
        engine.close()


def test_a_row_running_across_a_weight_change_offers_its_prefix_no_more(model, tokenizer, make_diverse_model):
    """New weights pushed while a row decodes (between two decode steps, as training pushes them): the row goes
    on over its old keys and values, but a prompt behind the same system prompt admitted after the push computes
    the whole prompt with the new weights instead of copying the running row's prefix."""
    engine = _engine(model, tokenizer)
    other = make_diverse_model(seed=5)
    prompts = [_prompt(tokenizer, f"Question {i}: what is {i} + {i}?") for i in range(2)]

    async def run():
        long = SamplingParams(temperature=1.0, max_tokens=150, ignore_eos=True, seed=1)
        first = asyncio.ensure_future(engine.generate(prompts[0], long))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.update_weights, other.state_dict())
        before = engine.stats()
        second = (await engine.generate(prompts[1], SamplingParams(temperature=1.0, max_tokens=8, seed=2)))[0]
        after = engine.stats()
        ran_throughout = not first.done()
        await first
        return second, before, after, ran_throughout

    try:
        second, before, after, ran_throughout = asyncio.run(run())
        assert ran_throughout
        assert after["prefix_cache_hits"] == before["prefix_cache_hits"]
        assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompts[1])
        assert teacher_forcing_gap(other, prompts[1], second) < 1e-4
    finally:
        engine.close()


def test_a_parked_history_moved_up_by_compaction_keeps_every_position(model, tokenizer):
    """A history of ~140 tokens parked in slot 0; twelve short rows, then a short-prompt row in slot 13 that
    outlives them: the batch moves that row down into slot 0 and the parked history up into slot 13, all of it
    (past the moved row's own position). The history's next turn takes slot 13 over, reads every position, and
    equals teacher forcing."""
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=16, max_model_len=256)
    history = _prompt(tokenizer, "Tell me a long story about numbers. " * 8)
    short = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}], add_generation_prompt=True)
    short = short["input_ids"]  # under one block: matches nothing
    try:
        first = _generate(engine, history)
        held = len(history) + len(first.token_ids) - 1
        assert held > 3 * len(short)

        async def crowded():
            generated = engine.stats()["tokens_generated"]
            rows = SamplingParams(temperature=1.0, max_tokens=3, n=12, ignore_eos=True, seed=3)
            batch = asyncio.ensure_future(engine.generate(short, rows))
            while engine.stats()["tokens_generated"] < generated + 12:  # slots 1..12 hold the short rows
                await asyncio.sleep(0.001)
            long = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=4)
            return await asyncio.gather(batch, engine.generate(short, long))  # the next free slot: 13

        compacted = engine.stats()["rows_compacted"]
        asyncio.run(crowded())
        _wait_for(lambda: engine.stats()["running"] == 0)
        assert engine.stats()["rows_compacted"] > compacted
        before = engine.stats()["prefix_cache_hits"]
        second_prompt = _next_turn(tokenizer, history, first, "And then?")
        second = _generate(engine, second_prompt)
        assert engine.stats()["prefix_cache_hits"] - before == held
        assert teacher_forcing_gap(model, second_prompt, second) < 1e-4
    finally:
        engine.close()


@pytest.mark.parametrize("steps", [1, 3])
def test_agents_churning_through_a_small_engine_get_exact_answers_whatever_the_cache_did(
    model, tokenizer, make_diverse_model, steps
):
    """Twenty agents over three system prompts, through an engine of twelve slots, their turns arriving at random
    moments: next turns take their parked histories over, copy prefixes from parked slots and from rows still
    running, evict each other's histories, and move with their rows when the batch packs them low. Two turns,
    new weights, two more. Every answer equals a teacher-forced forward of its whole sequence under the weights
    it was generated with (a prefix read from the wrong slot, a stale or overwritten one, would not). With
    `steps` decode steps per engine step, rows also end inside one and decode on past their ends."""
    engine = EmbeddedEngine(
        copy.deepcopy(model), tokenizer, max_num_seqs=12, max_model_len=512, num_scheduler_steps=steps
    )
    other = make_diverse_model(seed=5)
    systems = [f"Assistant {k}: " + ("answer briefly and in numbers. " * (2 + k)) for k in range(3)]

    def opening(agent):
        messages = [
            {"role": "system", "content": systems[agent % 3]},
            {"role": "user", "content": f"Agent {agent}: what is {agent} times {agent + 1}?"},
        ]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]

    async def turns(agent, prompt, first_turn, count):
        rng = random.Random(agent * 100 + first_turn)
        done = []
        for turn in range(first_turn, first_turn + count):
            await asyncio.sleep(rng.random() * 0.03)
            params = SamplingParams(temperature=1.0, max_tokens=rng.randint(2, 24), seed=agent * 10 + turn)
            out = (await engine.generate(prompt, params))[0]
            done.append((prompt, out))
            prompt = _next_turn(tokenizer, prompt, out, f"Turn {turn + 1} for agent {agent}: and then?")
        return done, prompt

    async def phase(prompts, first_turn):
        results = await asyncio.gather(*(turns(a, p, first_turn, 2) for a, p in enumerate(prompts)))
        return [r[0] for r in results], [r[1] for r in results]

    try:
        before, next_prompts = asyncio.run(phase([opening(a) for a in range(20)], 0))
        _wait_for(lambda: engine.stats()["running"] == 0)
        engine.update_weights(other.state_dict())
        after, _ = asyncio.run(phase(next_prompts, 2))
        stats = engine.stats()
        assert stats["prefix_cache_hits"] > stats["prefix_cache_queries"] / 4
        assert stats["rows_compacted"] > 0
        gaps = [teacher_forcing_gap(model, p, o) for agent in before for p, o in agent]
        gaps += [teacher_forcing_gap(other, p, o) for agent in after for p, o in agent]
        assert len(gaps) == 80 and max(gaps) < 1e-4
    finally:
        engine.close()


def test_an_evicted_prefix_is_recomputed_not_read(model, tokenizer):
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=2, max_model_len=256)
    try:
        first_prompt = _prompt(tokenizer, "What is 2+3?")
        first = _generate(engine, first_prompt)
        for text in (
            "Spell cat.",
            "Say hi twice.",
        ):  # two unrelated sequences: the second evicts the first's slot
            filler = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
            _generate(engine, filler["input_ids"], GREEDY)
        _wait_for(
            lambda: engine.stats()["parked_sequences"] == 2
        )  # a row parks just after its answer is sent
        before = engine.stats()["prefix_cache_hits"]
        second_prompt = _next_turn(tokenizer, first_prompt, first, "And 4+4?")
        second = _generate(engine, second_prompt)
        assert engine.stats()["prefix_cache_hits"] == before
        assert teacher_forcing_gap(model, second_prompt, second) < 1e-4
    finally:
        engine.close()


def _next_turn_after_a_push(engine, tokenizer, other):
    """A first turn, new weights `other` pushed, then the next turn: (first prompt, first answer, second prompt,
    second answer, prompt tokens the second read from the prefix cache)."""
    first_prompt = _prompt(tokenizer, "What is 2+3?")
    first = _generate(engine, first_prompt)
    engine.update_weights(other.state_dict())
    before = engine.stats()["prefix_cache_hits"]
    second_prompt = _next_turn(tokenizer, first_prompt, first, "And 4+4?")
    second = _generate(engine, second_prompt)
    return first_prompt, first, second_prompt, second, engine.stats()["prefix_cache_hits"] - before


def test_new_weights_forget_every_prefix(model, tokenizer, make_diverse_model):
    engine = _engine(model, tokenizer)
    try:
        other = make_diverse_model(seed=5)
        _, _, second_prompt, second, reused = _next_turn_after_a_push(engine, tokenizer, other)
        assert reused == 0
        assert teacher_forcing_gap(other, second_prompt, second) < 1e-4
    finally:
        engine.close()


def test_a_prefix_may_outlive_a_bounded_number_of_weight_changes(model, tokenizer, make_diverse_model):
    """`prefix_max_weight_changes=1` (asynchronous training's `reuse_stale_prefixes` at staleness 1): after one
    push the next turn reads its history's keys and values as the old weights computed them, and only its new
    tokens are computed by the new weights (checked against that forward, done by hand); after a second push
    the history is computed again."""
    engine = _engine(model, tokenizer, prefix_max_weight_changes=1)
    try:
        other = make_diverse_model(seed=5)
        first_prompt, first, second_prompt, second, reused = _next_turn_after_a_push(engine, tokenizer, other)
        assert reused == len(first_prompt) + len(first.token_ids) - 1  # all the history the slot held
        with torch.no_grad():  # the old weights' cache of the history, then the new weights over the rest
            history = model(torch.tensor([second_prompt[:reused]]), use_cache=True).past_key_values
            rest = second_prompt[reused:] + second.token_ids[:-1]
            logits = other(torch.tensor([rest]), past_key_values=history).logits[0].float()
        new_tokens = len(second_prompt) - reused
        expected = torch.log_softmax(logits[new_tokens - 1 :], -1).gather(
            1, torch.tensor(second.token_ids)[:, None]
        )
        assert (expected[:, 0] - torch.tensor(second.logprobs)).abs().max().item() < 1e-4
        assert teacher_forcing_gap(other, second_prompt, second) > 1e-3  # the old history really was read

        third_prompt = _next_turn(tokenizer, first_prompt, first, "And 5+5?")  # parked before both pushes
        engine.update_weights(make_diverse_model(seed=6).state_dict())
        engine.update_weights(other.state_dict())
        before = engine.stats()["prefix_cache_hits"]
        third = _generate(engine, third_prompt)
        assert engine.stats()["prefix_cache_hits"] == before
        assert teacher_forcing_gap(other, third_prompt, third) < 1e-4
    finally:
        engine.close()


def test_a_long_prompt_is_prefilled_in_chunks_that_attend_to_each_other(model, tokenizer):
    engine = _engine(model, tokenizer, prefill_chunk_tokens=16)
    try:
        prompt = _prompt(tokenizer, "Count slowly: " + " ".join(str(i) for i in range(20)))
        out = _generate(engine, prompt)
        stats = engine.stats()
        assert stats["prefill_forwards"] >= len(prompt) // 16
        assert stats["prefill_tokens"] == len(prompt)
        # Without CUDA graphs every forward is packed; the per-path counts add up to the totals.
        assert stats["prefill_packed_forwards"] == stats["prefill_forwards"]
        assert stats["prefill_packed_tokens"] == len(prompt) and stats["prefill_extend_tokens"] == 0
        assert stats["busy_prefill_packed_s"] == stats["busy_prefill_forward_s"] > 0
        assert 0 < stats["busy_prefill_packed_host_s"] <= stats["busy_prefill_packed_s"] + 1e-3
        assert teacher_forcing_gap(model, prompt, out) < 1e-4
    finally:
        engine.close()


def test_a_full_engine_reuses_the_slot_a_partial_match_copies_from(model, tokenizer):
    """One slot: the next turn shares only part of what the parked slot holds (its history was rewritten), and
    no other slot is free: the parked slot itself becomes the new row's, its matching prefix kept."""
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=1, max_model_len=256)
    try:
        first_prompt = _prompt(tokenizer, "What is 2+3?")
        _generate(engine, first_prompt)
        rewritten = first_prompt[:-4] + tokenizer("Something else entirely.")["input_ids"]
        out = _generate(engine, rewritten)
        assert engine.stats()["prefix_cache_hits"] >= 16
        assert teacher_forcing_gap(model, rewritten, out) < 1e-4
    finally:
        engine.close()


def test_next_turns_admitted_together_into_a_full_engine_all_reuse_their_histories(model, tokenizer):
    """Every slot parked, four next turns that rewrite their last tokens (each extends part of its own parked
    history, so each needs a new slot) admitted together: every slot is evicted for them, yet each still copies
    its history, none computed again (claiming slots one prompt at a time evicted histories later prompts of the
    same admission were to copy from)."""
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=4, max_model_len=256)

    def opening(i):
        messages = [{"role": "system", "content": f"{i} {i} {i}: " + "you answer in numbers only. " * 3}]
        return tokenizer.apply_chat_template(messages + [{"role": "user", "content": f"What is {i}+{i}?"}])[
            "input_ids"
        ]

    async def together(prompts):
        calls = [
            engine.generate(p, SamplingParams(temperature=1.0, max_tokens=6, seed=i))
            for i, p in enumerate(prompts)
        ]
        return [outs[0] for outs in await asyncio.gather(*calls)]

    try:
        firsts = [opening(i) for i in range(4)]
        asyncio.run(together(firsts))
        _wait_for(lambda: engine.stats()["parked_sequences"] == 4)
        rewritten = [p[:-4] + tokenizer(f" Tell me {i} again.")["input_ids"] for i, p in enumerate(firsts)]
        before = engine.stats()
        outs = asyncio.run(together(rewritten))
        after = engine.stats()
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= sum(len(p) - 4 for p in firsts)
        assert after["prefills"] - before["prefills"] == 1
        assert max(teacher_forcing_gap(model, p, o) for p, o in zip(rewritten, outs, strict=True)) < 1e-4
    finally:
        engine.close()
