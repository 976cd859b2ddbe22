"""The embedded engine against the model itself: greedy, logprobs, seeds, stops, weights, LoRA, sleep."""

import asyncio
import copy
import logging
import os
import threading
import time

import pytest
import torch

from agentrl.rollout.engines._slot_batch import SlotBatch
from agentrl.rollout.engines.embedded import (
    ADMISSION_WINDOW_S,
    ADMIT_MIN_SEQS,
    EmbeddedEngine,
    fingerprint_state_dict,
)
from agentrl.types import SamplingParams
from tests._teacher_forcing import teacher_forced_logprobs

pytestmark = pytest.mark.slow
MODEL = "tiny:qwen2-mini"


@pytest.fixture
def engine(model, tokenizer):
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=16, max_model_len=128)
    yield engine
    engine.close()


def test_greedy_equals_model_generate_while_batched_with_sampling(engine, model, prompts):
    async def run():
        greedy = [engine.generate(p, SamplingParams(temperature=0.0, max_tokens=24)) for p in prompts]
        noise = [engine.generate(p, SamplingParams(temperature=1.0, max_tokens=30, n=2)) for p in prompts]
        return await asyncio.gather(*greedy, *noise)

    results = asyncio.run(run())[: len(prompts)]
    distinct = set()
    for prompt, (out,) in zip(prompts, results, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24)[0, len(prompt) :]
        assert out.token_ids == ref.tolist()
        distinct.add(tuple(out.token_ids))
    assert len(distinct) == len(prompts)  # the test model really says different things


def test_sampled_logprobs_match_teacher_forcing(engine, model, prompts):
    async def run():
        settings = [
            SamplingParams(temperature=1.0, max_tokens=40, n=2),
            SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=33, seed=1),
        ]
        calls = [engine.generate(p, s, top_logprobs=2) for p in prompts for s in settings]
        return await asyncio.gather(*calls)

    worst, checked = 0.0, 0
    for (prompt, temperature), outputs in zip(
        [(p, t) for p in prompts for t in (1.0, 0.7)], asyncio.run(run()), strict=True
    ):
        for out in outputs:
            assert len(out.logprobs) == len(out.token_ids) == len(out.top_logprobs)
            reference = teacher_forced_logprobs(model, prompt, out.token_ids, temperature)
            worst = max(worst, (reference - torch.tensor(out.logprobs)).abs().max().item())
            checked += len(out.token_ids)
    assert checked > 200
    assert worst < 1e-4


def test_seed_reproducible_alone_or_in_a_crowd(engine, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=123, n=2)

    async def alone():
        return await engine.generate(prompts[0], params)

    async def crowd():
        others = [engine.generate(p, SamplingParams(temperature=1.0, max_tokens=25)) for p in prompts]
        return (await asyncio.gather(engine.generate(prompts[0], params), *others))[0]

    first, second = asyncio.run(alone()), asyncio.run(crowd())
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert first[0].token_ids != first[1].token_ids  # completion i uses seed + i


def test_stop_string_stop_token_and_length(engine, prompts):
    reference = asyncio.run(engine.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=30)))[0]
    assert reference.finish_reason == "length" and len(reference.token_ids) == 30
    text = reference.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    out = asyncio.run(
        engine.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]))
    )[0]
    assert out.finish_reason == "stop" and out.text == text[:cut]
    # token ids keep the tokens that spelled the stop string (they match their logprobs)
    assert out.token_ids == reference.token_ids[: len(out.token_ids)]
    assert stop in engine.decode(out.token_ids) and stop not in engine.decode(out.token_ids[:-1])

    stop_id = reference.token_ids[5]
    first = reference.token_ids.index(stop_id)
    params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id])
    out = asyncio.run(engine.generate(prompts[1], params))[0]
    assert out.finish_reason == "stop" and out.token_ids == reference.token_ids[: first + 1]


def test_prompt_limits(engine, prompts):
    with pytest.raises(ValueError, match="prompt has 128 tokens; max_model_len is 128"):
        asyncio.run(engine.generate([5] * 128, SamplingParams()))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(engine.generate([5, 999999], SamplingParams()))
    out = asyncio.run(engine.generate([5] * 120, SamplingParams(temperature=0.0, max_tokens=64)))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8  # clamped at max_model_len


def test_update_weights_changes_output_version_and_fingerprint(engine, prompts, make_diverse_model):
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    before = asyncio.run(engine.generate(prompts[0], greedy))[0].token_ids
    new_state = make_diverse_model(seed=1).state_dict()
    assert engine.weights_fingerprint() != fingerprint_state_dict(new_state)
    assert engine.update_weights(new_state) == 1 and engine.policy_version == 1
    assert engine.weights_fingerprint() == fingerprint_state_dict(new_state)
    after = asyncio.run(engine.generate(prompts[0], greedy))[0].token_ids
    assert after != before


def test_lora_adapter_changes_output_and_replaces_the_previous_one(engine, prompts, tmp_path):
    from peft import LoraConfig, get_peft_model

    def save_adapter(name, random_b):
        base = copy.deepcopy(engine.model)
        torch.manual_seed(0)
        config = LoraConfig(
            r=4,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj", "down_proj"],
            init_lora_weights=not random_b,
        )
        peft_model = get_peft_model(base, config)
        if random_b:
            with torch.no_grad():
                for n, p in peft_model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.5)
        peft_model.save_pretrained(str(tmp_path / name))
        return str(tmp_path / name)

    strong, identity = save_adapter("strong", True), save_adapter("identity", False)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    base_out = asyncio.run(engine.generate(prompts[0], greedy))[0].token_ids
    base_fp = engine.weights_fingerprint()
    assert engine.load_lora_adapter("strong", strong) == 1 and engine.lora_adapter == "strong"
    assert asyncio.run(engine.generate(prompts[0], greedy))[0].token_ids != base_out
    assert engine.weights_fingerprint() != base_fp
    assert type(engine.model).__name__ == "Qwen2ForCausalLM"  # merged, not wrapped
    engine.load_lora_adapter("identity", identity)  # B = 0: restores the base, adds nothing
    assert asyncio.run(engine.generate(prompts[0], greedy))[0].token_ids == base_out
    assert engine.weights_fingerprint() == base_fp
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.load_lora_adapter("x", str(tmp_path))


def test_sleep_holds_requests_until_wake_up(engine, prompts, caplog):
    async def run():
        engine.sleep()
        assert engine.is_sleeping
        task = asyncio.create_task(engine.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=5)))
        await asyncio.sleep(0.3)
        assert not task.done() and engine.stats()["waiting"] == 1
        engine.wake_up()
        out = await asyncio.wait_for(task, 30)
        assert len(out[0].token_ids) == 5
        long_run = SamplingParams(temperature=0.0, max_tokens=100)
        assert (await engine.generate(prompts[1], long_run))[0].finish_reason == "length"  # no early EOS
        events = engine.stream(prompts[1], long_run)
        first = await anext(events)  # the sequence is running now, 99 tokens to go
        assert first.finish_reason is None
        with pytest.raises(RuntimeError, match="cannot sleep"):
            engine.sleep()
        rest = [event async for event in events]
        assert rest[-1].finish_reason == "length" and len(rest[-1].output.token_ids) == 100
        while engine.stats()["running"]:
            await asyncio.sleep(0.001)

    asyncio.run(run())
    assert engine.stats()["tokens_generated"] > 0
    assert engine.stats()["kv_slots"] >= 105  # the slot cache stays allocated while awake...
    assert engine.stats()["kv_cache_gib"] > 0
    assert engine.stats()["fused_projections_gib"] > 0  # the concatenated q/k/v and gate/up copies
    engine.sleep()
    assert engine.stats()["kv_slots"] == 0 and engine.stats()["kv_cache_gib"] == 0  # ...and sleep frees it
    assert engine.stats()["fused_projections_gib"] == 0 and engine._batch.fused.layers == []  # the copies too
    engine.wake_up()
    assert engine.stats()["fused_projections_gib"] > 0
    rebuilt = engine.stats()["busy_cache_alloc_s"]
    caplog.clear()  # the first allocation above may have been logged (at INFO, once)
    with caplog.at_level(logging.INFO, logger="agentrl.rollout.engines._slot_batch"):
        asyncio.run(engine.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=2)))
    assert not [r for r in caplog.records if "KV cache of" in r.getMessage()]  # said once, not per wake-up
    assert engine.stats()["kv_slots"] >= 105  # the first request after waking rebuilds the cache...
    assert engine.stats()["busy_cache_alloc_s"] > rebuilt  # ...and that time is reported
    assert engine.stats()["busy_graph_capture_s"] == 0.0  # no CUDA graphs on CPU


def test_slot_cache_grows_while_rows_run_and_logprobs_stay_exact(model, tokenizer, prompts):
    """A long request admitted next to running rows grows the slot cache (256 -> 512 positions) mid-flight."""
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=8, max_model_len=1024)
    try:

        async def run():
            short = SamplingParams(temperature=1.0, max_tokens=120, n=3, seed=5, ignore_eos=True)
            long = SamplingParams(temperature=1.0, max_tokens=300, seed=6, ignore_eos=True)
            first = asyncio.create_task(engine.generate(prompts[0], short))
            while engine.stats()["tokens_generated"] < 30:  # the short rows are running
                await asyncio.sleep(0.001)
            assert engine.stats()["kv_slots"] == 256
            second = await engine.generate(prompts[1], long)
            return await first, second

        short_out, long_out = asyncio.run(run())
        assert engine.stats()["kv_slots"] == 512
        for prompt, out in [(prompts[0], o) for o in short_out] + [(prompts[1], long_out[0])]:
            reference = teacher_forced_logprobs(model, prompt, out.token_ids)
            assert (reference - torch.tensor(out.logprobs)).abs().max().item() < 1e-4
        assert len(long_out[0].token_ids) == 300
    finally:
        engine.close()


def test_a_compiled_cpu_decode_step_compiles_on_the_engines_thread_and_stays_exact(model, tokenizer, prompts):
    """`compile_decode` on the CPU: the decode step goes through torch.compile, on the engine's own thread (this
    thread only waits: a compile here would leave it an OpenMP pool that slows the engine's), and rows that
    cross several cache spans (each a size the compiled step takes symbolically) keep teacher-forced logprobs,
    also while the step reads the 96-token preamble the prompts share once (`shared_prefix_attention.py`)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    engine = EmbeddedEngine(
        copy.deepcopy(model), tokenizer, max_num_seqs=8, max_model_len=512, compile_decode=True
    )
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    try:
        assert engine.stats()["compile_decode"] is True
        assert cpu < 0.5 * wall, f"the constructor's thread spent {cpu:.1f} of {wall:.1f} s computing"

        preamble = [(13 * i) % 1500 + 7 for i in range(96)]
        shared = [preamble + p for p in prompts[:3]]

        async def run():
            params = SamplingParams(temperature=1.0, max_tokens=150, n=2, seed=3, ignore_eos=True)
            return await asyncio.gather(*(engine.generate(p, params) for p in shared))

        for prompt, outputs in zip(shared, asyncio.run(run()), strict=True):
            for out in outputs:
                reference = teacher_forced_logprobs(model, prompt, out.token_ids)
                assert (reference - torch.tensor(out.logprobs)).abs().max().item() < 1e-4
        # every step of the 150 read the preamble (and each prompt, its two rows' whole prompt) once
        assert engine.stats()["decode_shared_prefix_steps"] >= 149
    finally:
        engine.close()


def _process_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_sleeping_engine_and_the_thread_that_wakes_it_give_their_openmp_workers_back(model, tokenizer):
    """The hybrid engine's two threads take turns on the CPU: asleep, the engine's thread ends its OpenMP pool
    (the trainer's update has the cores), and `wake_up` ends the calling thread's (it now waits for rollouts).
    Two pools on as many cores as threads made a CPU training step 1.33x slower (`make train`)."""
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=8, max_model_len=1024, threads=3)
    try:
        long_prompts = [[(7 * i + j) % 2000 + 3 for j in range(500)] for i in range(8)]
        params = SamplingParams(max_tokens=4, ignore_eos=True)

        async def run():
            await asyncio.gather(*(engine.generate(p, params) for p in long_prompts))

        # a prefill of 4,000 tokens: parallel regions, the engine thread's pool of 2 workers
        asyncio.run(run())
        with_pool = _process_threads()
        engine.sleep()
        assert _until(lambda: _process_threads() == with_pool - 2), (with_pool, _process_threads())

        counts = {}

        def trainer() -> None:
            torch.set_num_threads(3)
            torch.ones(4_000_000).mul_(2).sum()  # an update's parallel work: this thread's pool
            counts["updating"] = _process_threads()
            engine.wake_up()
            # The pool's workers end on their own, soon after: waited for here, in the thread whose pool it is.
            counts["released"] = _until(lambda: _process_threads() == counts["updating"] - 2)
            counts["rolling out"] = _process_threads()

        thread = threading.Thread(target=trainer)
        thread.start()
        thread.join()
        assert counts["released"], counts
        outs = asyncio.run(engine.generate(long_prompts[0], params))  # awake: generates again
        assert len(outs[0].token_ids) == 4
    finally:
        engine.close()


def test_min_tokens_blocks_stop_tokens_from_being_drawn(engine, prompts):
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    first = asyncio.run(engine.generate(prompts[0], greedy))[0].token_ids[0]
    blocked = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, stop_token_ids=[first])
    out = asyncio.run(engine.generate(prompts[0], blocked))[0]
    assert first not in out.token_ids[:3]  # the argmax was blocked, another token was chosen
    assert len(out.token_ids) >= 3


def test_a_burst_into_an_idle_engine_is_one_prefill_despite_a_pause(model, tokenizer, prompts):
    """A rollout's first calls reach an idle engine one after another (~1.4 ms apart on an H100 host, with
    pauses of several ms): 40 arrivals ~4 ms apart with a 7 ms pause are admitted together, not in waves."""
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=64, max_model_len=128)

    async def run():
        calls = []
        for i in range(40):
            calls.append(
                asyncio.create_task(engine.generate(prompts[i % 4], SamplingParams(max_tokens=4, seed=i)))
            )
            await asyncio.sleep(0.007 if i == 20 else 0.003)
        return await asyncio.gather(*calls)

    try:
        outs = asyncio.run(run())
        prefills = engine.stats()["prefills"]
    finally:
        engine.close()
    assert all(len(out.token_ids) == 4 for (out,) in outs)
    assert prefills <= 2, prefills  # one, or two if the event loop stalled; 4-6 with a 0.1 s window


def test_arrivals_while_rows_run_are_batched_into_few_prefills(engine, prompts):
    """24 requests arriving 1 ms apart next to a running row: a handful of prefills, not one per arrival.

    While rows run, waiting requests are admitted once they number ADMIT_MIN_SEQS or the oldest has waited
    ADMISSION_WINDOW_S: so at most one prefill per ADMIT_MIN_SEQS arrivals, one for a remainder that waits out
    the window, and one more per window the arrivals themselves took (a loaded host stretches them)."""

    async def run():
        running = asyncio.create_task(
            engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=90))
        )
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.001)
        before = engine.stats()["prefills"]
        calls = []
        started = time.monotonic()
        for i in range(24):
            calls.append(
                asyncio.create_task(engine.generate(prompts[i % 4], SamplingParams(max_tokens=8, seed=i)))
            )
            await asyncio.sleep(0.001)
        arrivals_s = time.monotonic() - started
        outs = await asyncio.gather(*calls)
        await running
        return engine.stats()["prefills"] - before, outs, arrivals_s

    prefills, outs, arrivals_s = asyncio.run(run())
    assert all(len(out.token_ids) == 8 for (out,) in outs)
    allowed = 24 // ADMIT_MIN_SEQS + 1 + int(arrivals_s / ADMISSION_WINDOW_S)
    assert prefills <= allowed, (prefills, allowed, arrivals_s)


def test_next_turns_that_fill_the_free_slots_still_wait_to_be_batched(model, tokenizer, prompts):
    """Agents' next turns when `max_num_seqs` equals the episodes: every free slot belongs to an episode between
    turns, so each next turn alone fills the free slots. They are still batched (ADMIT_MIN_SEQS or the window)
    while rows run: admitting each as it filled the slots made one prefill per turn."""
    episodes = 8
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_num_seqs=episodes, max_model_len=128)

    async def episode(i: int) -> float:
        params = SamplingParams(max_tokens=6 + i, seed=i, ignore_eos=True)  # one episode's turn ends per step
        await engine.generate(prompts[i % 4], params)
        arrived = time.monotonic()
        await engine.generate(prompts[(i + 1) % 4], SamplingParams(max_tokens=30, seed=i, ignore_eos=True))
        return arrived

    async def run():
        first = engine.stats()["prefills"]
        arrivals = await asyncio.gather(*[episode(i) for i in range(episodes)])
        return engine.stats()["prefills"] - first, max(arrivals) - min(arrivals)

    try:
        prefills, arrivals_s = asyncio.run(run())
    finally:
        engine.close()
    allowed = 2 + 1 + int(arrivals_s / ADMISSION_WINDOW_S)  # the first turns' burst, then the next turns
    assert prefills <= min(allowed, episodes - 2), (prefills, allowed, arrivals_s)


def test_draws_on_the_device_one_step_ahead_equal_the_host_schedule(engine, prompts):
    """Seeded rows give the same tokens and logprobs whether they draw on the device one step ahead, or on the
    host's schedule because a request with top logprobs shares the batch for a while (switching both ways)."""
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=s, ignore_eos=True) for s in (1, 2)
    ]

    async def alone():
        return await asyncio.gather(*[engine.generate(p, q) for p, q in zip(prompts, params, strict=False)])

    async def interrupted():
        calls = [asyncio.create_task(engine.generate(p, q)) for p, q in zip(prompts, params, strict=False)]
        while engine.stats()["tokens_generated"] < before + 20:
            await asyncio.sleep(0.001)
        side = await engine.generate(prompts[2], SamplingParams(max_tokens=6, seed=9), top_logprobs=2)
        return await asyncio.gather(*calls), side

    first = engine.stats()
    reference = asyncio.run(alone())
    before = engine.stats()["tokens_generated"]
    mixed, (side,) = asyncio.run(interrupted())
    after = engine.stats()
    assert [o.token_ids for (o,) in mixed] == [o.token_ids for (o,) in reference]
    assert [o.logprobs for (o,) in mixed] == [o.logprobs for (o,) in reference]
    assert len(side.top_logprobs) == 6
    assert after["decode_steps_host"] - first["decode_steps_host"] >= 5  # the side request ran on the host
    assert after["decode_steps_device"] - first["decode_steps_device"] >= 40 + 20  # before and after it


def test_retiring_finished_rows_counts_as_host_time(engine, prompts, monkeypatch):
    """Retiring finished rows (parking their slots, resetting them on the device) is the scheduler's work:
    `busy_host_s` (`timing/engine_host`) holds it. On a GPU host it waited for the GIL ~8 ms a retirement
    in the 8-turn agent benchmark, half the engine thread's time, and no timer counted it."""
    keep = SlotBatch.keep

    def slow_keep(self, *args, **kwargs):
        time.sleep(0.05)
        return keep(self, *args, **kwargs)

    monkeypatch.setattr(SlotBatch, "keep", slow_keep)

    async def run():
        lengths = (3, 9)  # two retirements: the rows finish at different steps
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
        return await asyncio.gather(*[engine.generate(prompts[0], p) for p in params])

    before = engine.stats()["busy_host_s"]
    outputs = asyncio.run(run())
    assert [len(o.token_ids) for (o,) in outputs] == [3, 9]
    deadline = time.monotonic() + 5  # the last answer is delivered before its row retires
    while engine.stats()["busy_host_s"] - before < 0.1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats()["busy_host_s"] - before >= 0.1


def test_a_long_answer_outliving_its_batch_moves_to_a_low_slot_and_draws_the_same(engine, model, prompts):
    """The last row running in a high slot (the slowest answer of a step) is moved to the lowest free or parked
    slot, so its decode steps compute 8 slots instead of 16; it draws the same seeded tokens as alone, and its
    logprobs equal teacher forcing."""
    long = SamplingParams(temperature=1.0, max_tokens=40, seed=5, ignore_eos=True)
    short = SamplingParams(temperature=1.0, max_tokens=3, n=12, ignore_eos=True)

    async def crowded():
        first = asyncio.create_task(engine.generate(prompts[0], short))
        while engine.stats()["tokens_generated"] < generated + 12:  # slots 0..12 hold the short rows
            await asyncio.sleep(0.001)
        return await asyncio.gather(first, engine.generate(prompts[1], long))  # the next free slot: 13

    (alone,) = asyncio.run(engine.generate(prompts[1], long))
    before, generated = engine.stats()["rows_compacted"], engine.stats()["tokens_generated"]
    _, (out,) = asyncio.run(crowded())
    assert engine.stats()["rows_compacted"] > before
    assert out.token_ids == alone.token_ids
    torch.testing.assert_close(out.logprobs, alone.logprobs, atol=1e-5, rtol=0)  # other batch shapes
    reference = teacher_forced_logprobs(model, prompts[1], out.token_ids)
    assert (reference - torch.tensor(out.logprobs)).abs().max().item() < 1e-4


def test_a_failed_step_costs_its_requests_not_the_engine(engine, prompts, monkeypatch):
    """A step that fails fails the running requests and the ones it was admitting (none waits forever), each
    counted as an error in the metrics, and the engine serves the next request."""
    real_step, failures = engine._step_on_device, []
    errors = engine.stats()["request_metrics"]["finished"]["error"]

    def failing_step(admitted):
        if admitted and engine._rows and not failures:
            failures.append(len(admitted))
            raise RuntimeError("injected step failure")
        return real_step(admitted)

    monkeypatch.setattr(engine, "_step_on_device", failing_step)

    async def run():
        running = asyncio.create_task(
            engine.generate(prompts[0], SamplingParams(max_tokens=100, ignore_eos=True, seed=1))
        )
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.001)
        arriving = asyncio.create_task(engine.generate(prompts[1], SamplingParams(max_tokens=5, seed=2)))
        return await asyncio.wait_for(asyncio.gather(running, arriving, return_exceptions=True), timeout=60)

    results = asyncio.run(run())
    assert failures == [1]
    assert all(isinstance(r, RuntimeError) and "injected" in str(r) for r in results), results
    assert engine.stats()["request_metrics"]["finished"]["error"] == errors + 2
    assert (
        len(asyncio.run(engine.generate(prompts[2], SamplingParams(max_tokens=4, seed=3)))[0].token_ids) == 4
    )


def test_draw_on_device_off_reads_every_step_on_the_host_and_draws_the_same(
    engine, model, tokenizer, prompts
):
    params = SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=4, ignore_eos=True)
    host = EmbeddedEngine(
        copy.deepcopy(model), tokenizer, max_num_seqs=16, max_model_len=128, draw_on_device=False
    )
    try:
        on_host = asyncio.run(host.generate(prompts[1], params))
        assert host.stats()["decode_steps_device"] == 0 and host.stats()["decode_steps_host"] >= 11
    finally:
        host.close()
    on_device = asyncio.run(engine.generate(prompts[1], params))
    assert engine.stats()["decode_steps_host"] == 0 and engine.stats()["decode_steps_device"] >= 11
    assert [o.token_ids for o in on_device] == [o.token_ids for o in on_host]
    assert [o.logprobs for o in on_device] == [o.logprobs for o in on_host]


def test_a_request_cancelled_while_waiting_is_never_run(engine, prompts):
    """A rollout that times out (its task cancelled) while its request waits must not run later: at the
    next wake-up it would take slots and decode for nobody (the trainer's next step got them)."""

    async def run():
        engine.sleep()
        task = asyncio.create_task(
            engine.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=30))
        )
        while engine.stats()["waiting"] == 0:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        before = engine.stats()["tokens_generated"]
        engine.wake_up()
        out = await engine.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=3))
        while engine.stats()["running"] or engine.stats()["waiting"]:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # the scheduler counts a step's tokens just after delivering them
        return before, out

    before, out = asyncio.run(run())
    assert len(out[0].token_ids) == 3
    assert engine.stats()["tokens_generated"] - before == 3  # the cancelled request drew nothing


def test_a_request_whose_event_loop_closed_while_waiting_is_never_run(engine, prompts):
    """A stream opened and never read leaves its request queued; once its event loop is gone (a training
    step's `asyncio.run` ended) nobody can receive its tokens, so admission drops it."""
    engine.sleep()
    loop = asyncio.new_event_loop()

    async def open_stream():
        return engine.stream(prompts[0], SamplingParams(temperature=0.0, max_tokens=30))

    loop.run_until_complete(open_stream())  # enqueued at once; the stream is never iterated
    loop.close()
    assert engine.stats()["waiting"] == 1
    before = engine.stats()["tokens_generated"]
    engine.wake_up()

    async def run():
        out = await engine.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=3))
        while engine.stats()["running"] or engine.stats()["waiting"]:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        return out

    assert len(asyncio.run(run())[0].token_ids) == 3
    assert engine.stats()["tokens_generated"] - before == 3
