"""Chunked prefill in the embedded engine: while rows decode, a long prompt is computed in parts over several engine
steps, a decode step of the running rows between each, and what it generates is exactly what a teacher-forced
forward of the whole sequence gives."""

import asyncio
import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.models import load_tokenizer, resolve_model_path
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.rollout.serving.embedded import start_embedded_serving
from agentrl.types import SamplingParams
from tests._teacher_forcing import teacher_forcing_gap

pytestmark = pytest.mark.slow
RUNNING = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
"""The row that decodes while the long prompt arrives: it outlives the long prompt's prefill."""
LONG = SamplingParams(temperature=1.0, max_tokens=6, seed=3)
LONG_RUNNING = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
PART = 32


def _engine(model, tokenizer, **kwargs):
    return EmbeddedEngine(
        copy.deepcopy(model),
        tokenizer,
        max_num_seqs=4,
        max_model_len=512,
        prefill_chunk_tokens=PART,
        **kwargs,
    )


def _spy_on_parts(engine):
    """Decode steps run so far each time a part is computed (the real `prefill_part` runs)."""
    seen: list[int] = []
    real = engine._batch.prefill_part

    def recording(tokens, reserve):
        seen.append(sum(engine._decode_steps.values()))
        return real(tokens, reserve)

    engine._batch.prefill_part = recording
    return seen


def while_a_row_decodes(engine, short, long, running_params=RUNNING, long_params=LONG):
    """Start `short` decoding, then send `long` once the first has tokens; both outputs (the GPU test uses it
    too)."""

    async def run():
        first_token = asyncio.Event()

        async def running():
            out = None
            async for event in engine.stream(short, running_params):
                first_token.set()
                out = event.output or out
            return out

        task = asyncio.create_task(running())
        await first_token.wait()
        out = (await engine.generate(long, long_params))[0]
        return await task, out

    return asyncio.run(run())


def _prompts(tokenizer):
    short = tokenizer("Tell me a story about a lighthouse.")["input_ids"]
    long = tokenizer(" ".join(f"item {i} weighs {3 * i % 17} kg;" for i in range(40)))["input_ids"]
    assert len(long) > 6 * PART
    return short, long


def test_a_long_prompt_is_prefilled_in_parts_with_a_decode_step_between_each(model, tokenizer):
    engine = _engine(model, tokenizer)
    parts = _spy_on_parts(engine)
    try:
        short, long = _prompts(tokenizer)
        running, out = while_a_row_decodes(engine, short, long)
        stats = engine.stats()
        assert len(parts) >= (len(long) - 1) // PART - 1 >= 5
        assert stats["prefill_parts"] == len(parts)
        # The running row decoded between every two parts: its decode steps went on through the prefill.
        assert all(later > earlier for earlier, later in zip(parts, parts[1:], strict=False)), parts
        assert len(running.token_ids) == RUNNING.max_tokens
        # Each token computed once, and the parts the engine computed itself are not prefix cache hits.
        assert stats["prefill_tokens"] == len(short) + len(long)
        assert stats["prefix_cache_hits"] == 0
        assert teacher_forcing_gap(model, long, out) < 1e-4
        assert teacher_forcing_gap(model, short, running) < 1e-4
    finally:
        engine.close()


def test_a_part_that_fails_fails_its_prompt_and_the_running_row_and_the_engine_serves_on(model, tokenizer):
    """A step whose part of a long prompt fails: the prompt being computed in parts (still waiting) and the row
    decoding beside it both get the error, each counted as an error in the metrics, and the engine answers the
    next request."""
    engine = _engine(model, tokenizer)
    real, failures = engine._batch.prefill_part, []

    def failing(tokens, reserve):
        if not failures:
            failures.append(len(tokens))
            raise RuntimeError("injected part failure")
        return real(tokens, reserve)

    engine._batch.prefill_part = failing
    try:
        short, long = _prompts(tokenizer)
        errors = engine.stats()["request_metrics"]["finished"]["error"]
        with pytest.raises(RuntimeError, match="injected part failure"):
            while_a_row_decodes(engine, short, long)
        deadline = (
            time.monotonic() + 5
        )  # the running row fails once the step's error reaches the engine's loop
        while engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = engine.stats()
        assert failures and stats["running"] == 0 and stats["waiting"] == 0
        assert stats["request_metrics"]["finished"]["error"] == errors + 2
        assert asyncio.run(engine.generate(short, LONG))[0].token_ids
    finally:
        engine.close()


def test_a_burst_is_admitted_over_steps_within_the_budget_and_identical_prompts_count_once(model, tokenizer):
    """While a row decodes: four different 48-token prompts (two would pass the 64-token budget) are admitted one
    a step; eight identical ones (a GRPO group sent as n=1 requests, computed once) in one step."""
    engine = EmbeddedEngine(
        copy.deepcopy(model), tokenizer, max_num_seqs=12, max_model_len=512, prefill_chunk_tokens=64
    )
    params = SamplingParams(temperature=1.0, max_tokens=2, seed=5)
    different = [list(range(100 + 50 * i, 148 + 50 * i)) for i in range(4)]
    same = [list(range(400, 448))] * 8

    async def run():
        first_token, done = asyncio.Event(), asyncio.Event()

        async def running():
            async for _ in engine.stream(tokenizer("Once upon a time")["input_ids"], LONG_RUNNING):
                first_token.set()
            done.set()

        task = asyncio.create_task(running())
        await first_token.wait()
        counts = [engine.stats()["prefills"]]
        outs = await asyncio.gather(*(engine.generate(p, params) for p in different))
        counts.append(engine.stats()["prefills"])
        await asyncio.gather(*(engine.generate(p, params) for p in same))
        counts.append(engine.stats()["prefills"])
        still_running = not done.is_set()
        await task
        return counts, still_running, outs[0][0]

    try:
        counts, still_running, out = asyncio.run(run())
        assert still_running, "the decoding row finished before the bursts: nothing was budgeted"
        assert counts[1] - counts[0] == 4
        assert counts[2] - counts[1] == 1
        assert teacher_forcing_gap(model, different[0], out) < 1e-4
    finally:
        engine.close()


def test_chunked_prefill_off_prefills_the_long_prompt_in_one_step(model, tokenizer):
    engine = _engine(model, tokenizer, chunked_prefill=False)
    parts = _spy_on_parts(engine)
    try:
        short, long = _prompts(tokenizer)
        _, out = while_a_row_decodes(engine, short, long)
        stats = engine.stats()
        assert parts == [] and stats["prefill_parts"] == 0
        assert stats["prefill_forwards"] >= len(long) // PART  # its chunks ran back to back, in one step
        assert teacher_forcing_gap(model, long, out) < 1e-4
    finally:
        engine.close()


def test_an_idle_engine_prefills_a_long_prompt_whole(model, tokenizer):
    """Nothing decodes that a long prefill could stall: no parts, the admission as before."""
    engine = _engine(model, tokenizer)
    parts = _spy_on_parts(engine)
    try:
        _, long = _prompts(tokenizer)
        out = asyncio.run(engine.generate(long, LONG))[0]
        assert parts == [] and engine.stats()["prefill_parts"] == 0
        assert teacher_forcing_gap(model, long, out) < 1e-4
    finally:
        engine.close()


def test_prefix_caching_off_turns_chunked_prefill_off(model, tokenizer):
    """The parts wait in the prefix cache between steps: without it the engine prefills admissions whole."""
    engine = _engine(model, tokenizer, enable_prefix_caching=False)
    try:
        assert not engine.chunked_prefill
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("setting", "chunked"), [([], True), (["actor_rollout_ref.rollout.enable_chunked_prefill=false"], False)]
)
def test_the_rollout_keys_reach_the_engine(setting, chunked):
    """`enable_chunked_prefill` (on by default, as in vLLM) and its budget `max_num_batched_tokens`."""
    config = load_config(
        [
            "actor_rollout_ref.model.path=tiny:qwen2-mini",
            "actor_rollout_ref.rollout.max_num_batched_tokens=48",
        ]
        + setting
    )
    path = resolve_model_path(config.actor_rollout_ref.model.path)
    serving = start_embedded_serving(path, load_tokenizer(path), config, device="cpu")
    try:
        assert serving.engine.chunked_prefill is chunked
        assert serving.engine.prefill_chunk_tokens == 48
    finally:
        serving.stop()


def test_the_benchmark_compares_both_settings_in_one_process():
    """`benchmarks/chunked_prefill.py` at a small size: a row per setting, parts only when chunked, the ratios."""
    bench = Path(__file__).resolve().parents[3] / "benchmarks" / "chunked_prefill.py"
    args = ["--prompt-len", "300", "--budget", "64", "--rows", "2", "--decode-tokens", "60"]
    done = subprocess.run([sys.executable, str(bench), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in done.stdout.splitlines()
        if line.startswith("| ")
    }
    assert float(rows["chunked"][4]) >= 300 // 64 - 1 and float(rows["whole"][4]) == 0
    assert "chunked / whole: longest gap" in done.stdout
