"""The embedded engine's CUDA fast path on a real-size model: slot cache + CUDA graphs, exact and seeded.

Run on the device machine (docs/development.md). A Qwen2.5-0.5B-shaped model in float32: logprobs the engine
reports while sampling equal a teacher-forced forward of the same weights, and graph replay draws the same tokens
as eager decoding for the same seeds.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from agentrl.models import load_causal_lm, load_tokenizer
from agentrl.rollout.engines import _compiled_steps, _slot_batch
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.types import SamplingParams
from tests.gpu._teacher_forcing import worst_logprob_gap
from tests.integration.rollout.test_chunked_prefill import while_a_row_decodes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)"),
]
SHAPE = "tiny:qwen2.5-0.5b-shape"


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(SHAPE, dtype="float32", device="cuda").eval()


TEMPERATURES = [1.0, 0.7] * 4
"""Per prompt: the logprobs reported at 0.7 are of softmax(z / 0.7), what the trainer computes."""


def _engine(model, **options) -> EmbeddedEngine:
    """An engine of 32 sequences (unless `max_num_seqs` says) x 512 positions over `model`."""
    options = {"max_num_seqs": 32, **options}
    return EmbeddedEngine(model, load_tokenizer(SHAPE), max_model_len=512, **options)


def _complete_all(engine: EmbeddedEngine, prompts, params):
    """Every prompt's completions, the prompts sent at once."""

    async def run():
        return await asyncio.gather(*[engine.generate(p, params) for p in prompts])

    return asyncio.run(run())


def _generate(model, cuda_graphs: bool, compile_decode: bool = False):
    engine = _engine(model, cuda_graphs=cuda_graphs, compile_decode=compile_decode)
    prompts = [[(17 * p + 5 * i) % 5000 + 10 for i in range(20 + 7 * p)] for p in range(8)]

    async def run():
        return await asyncio.gather(
            *[
                engine.generate(p, SamplingParams(temperature=t, max_tokens=48, n=4, seed=3, ignore_eos=True))
                for p, t in zip(prompts, TEMPERATURES, strict=True)
            ]
        )

    try:
        return prompts, asyncio.run(run()), engine.stats()
    finally:
        engine.close()


@pytest.mark.parametrize("compile_decode", [False, True], ids=["graphs", "compiled-graphs"])
def test_graph_decoding_logprobs_equal_teacher_forcing_and_a_rerun_draws_the_same_tokens(
    model, compile_decode
):
    """Graph (and compiled) decoding reports exact logprobs and, run again, draws the same tokens. Eager decoding
    is held to exact logprobs only: without graphs short prompts are prefilled packed, whose kernels sum in
    another order than the graph's extend step, so a draw within ~1e-6 of a boundary between two tokens may
    pick the neighbour (5 of 32 completions diverged somewhere in 48 tokens on an H100, at 0.7 and at 1.0)."""
    prompts, first, stats = _generate(model, cuda_graphs=True, compile_decode=compile_decode)
    _, again, _ = _generate(model, cuda_graphs=True, compile_decode=compile_decode)
    flips = [
        (
            p,
            TEMPERATURES[p],
            c,
            next(i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids, strict=True)) if a != b),
        )
        for p, (outs, others) in enumerate(zip(first, again, strict=True))
        for c, (x, y) in enumerate(zip(outs, others, strict=True))
        if x.token_ids != y.token_ids
    ]
    assert not flips, f"(prompt, temperature, completion, first differing token): {flips}"
    worst = worst_logprob_gap(model, prompts, first, TEMPERATURES)
    assert worst < 1e-3, worst
    assert len({tuple(o.token_ids) for outs in first for o in outs}) == 32  # they really sample
    # Prompts of up to 64 tokens went through the extend graphs, the 69-token one packed; both paths are timed.
    long = [len(p) for p in prompts if len(p) > _slot_batch.EXTEND_MAX_TOKENS]
    assert stats["prefill_packed_tokens"] == sum(long) and stats["prefill_packed_forwards"] >= 1
    assert stats["prefill_extend_tokens"] == sum(len(p) for p in prompts) - sum(long)
    assert stats["busy_prefill_extend_s"] > 0 and stats["busy_prefill_packed_s"] > 0
    if not compile_decode:
        _, eager, _ = _generate(model, cuda_graphs=False)
        worst = worst_logprob_gap(model, prompts, eager, TEMPERATURES)
        assert worst < 1e-3, worst


def test_the_decode_step_compiles_when_the_engine_is_built_not_in_the_first_rollout(model, caplog):
    """Compiling in the first decode made the first rollouts wait ~60-120 s, counted against agent.timeout (an
    H100 host timed out every episode of step 1). Built from a cold compiler, the engine compiles its decode and
    extend steps at once (neither falls back to the plain step) and frees the cache it used; the first request
    then only captures a graph."""
    torch._dynamo.reset()
    _compiled_steps._COMPILED.clear()
    start = time.perf_counter()
    with caplog.at_level("WARNING", logger=_slot_batch.__name__):
        engine = _engine(model, cuda_graphs=True, compile_decode=True)
    built = time.perf_counter() - start
    try:
        assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
        assert engine.stats()["kv_slots"] == 0
        params = SamplingParams(temperature=1.0, max_tokens=16, n=4, seed=1, ignore_eos=True)
        outs = asyncio.run(engine.generate(list(range(10, 40)), params))
        assert [len(o.token_ids) for o in outs] == [16] * 4
        capture = engine.stats()["busy_graph_capture_s"]
        assert 0 < capture < built / 4, (capture, built)
    finally:
        engine.close()


def test_graphs_survive_an_in_place_weight_update_and_replay_the_new_weights():
    """An optimizer step writes the hybrid engine's shared weights in place: the captured graphs are kept (a
    graph reads its weights by address) and replay the new values, as a teacher-forced forward of the new
    weights shows. A weight that moved to new memory drops them, and they are captured again."""
    model = load_causal_lm(SHAPE, dtype="float32", device="cuda").eval()
    engine = _engine(model, cuda_graphs=True)
    prompts = [[(13 * p + 3 * i) % 5000 + 10 for i in range(24 + 5 * p)] for p in range(4)]
    params = SamplingParams(temperature=1.0, max_tokens=24, n=2, seed=5, ignore_eos=True)

    def generate():
        return _complete_all(engine, prompts, params)

    try:
        before = generate()
        graphs = dict(engine._batch._graphs)
        assert graphs
        with torch.no_grad():
            model.model.norm.weight.mul_(1.5)
            model.model.layers[3].mlp.up_proj.weight.add_(
                0.05 * torch.randn_like(model.model.layers[3].mlp.up_proj.weight)
            )
            # q/k/v and gate/up reach the steps through the fused copies (`_fused_projections.py`)
            model.model.layers[2].self_attn.k_proj.weight.mul_(1.3)
        engine.mark_weights_updated()
        assert engine._batch._graphs == graphs, "an in-place update dropped the graphs"
        after = generate()
        assert [o.token_ids for outs in after for o in outs] != [o.token_ids for outs in before for o in outs]
        assert worst_logprob_gap(model, prompts, after) < 1e-3  # the replays read the new weights
        moved = model.model.layers[5].self_attn.o_proj
        moved.weight.data = moved.weight.data.clone()
        engine.mark_weights_updated()
        assert not engine._batch._graphs, "a moved weight kept graphs that read its old memory"
        again = generate()
        assert engine._batch._graphs
        assert worst_logprob_gap(model, prompts, again) < 1e-3
    finally:
        engine.close()


@pytest.mark.parametrize(
    "owns_weights, settled",
    [(False, False), (True, False), (True, True)],
    ids=["trainer-weights", "own-weights", "own-weights-settled"],
)
def test_a_sleep_returns_the_cache_memory_and_keeps_its_addresses_and_graphs(owns_weights, settled):
    """The hybrid engine sleeps while the trainer runs. The cache's pages go back to the driver (its free memory
    grows by all of them, and the trainer may fill them with anything: here NaN bytes), its addresses stay, so
    the graphs captured before the sleep replay after it: the same seeds draw the same tokens with no new
    capture, and the logprobs still equal teacher forcing (fresh pages are zeroed: a NaN left in a masked
    position would poison attention). An engine that owns its weights parks them on the host: at the first
    wake they move to addresses of their own (graphs captured again), from then on they come back there; one
    built to sleep between steps moves them there before its first graph (`settled`: no capture again)."""
    model = load_causal_lm(SHAPE, dtype="float32", device="cuda").eval()
    engine = _engine(model, cuda_graphs=True, owns_weights=owns_weights, sleeps_between_steps=settled)
    prompts = [[(11 * p + 7 * i) % 5000 + 10 for i in range(20 + 9 * p)] for p in range(4)]
    params = SamplingParams(temperature=1.0, max_tokens=24, n=2, seed=9, ignore_eos=True)
    batch = engine._batch

    def generate():
        outs = _complete_all(engine, prompts, params)
        return [o.token_ids for each in outs for o in each], outs

    def sleep_and_wake():
        """Sleep (checking the memory it returns, then filling it as a trainer would), wake, generate again:
        whether every graph from before was kept, and the new tokens."""
        graphs, addresses = dict(batch._graphs), [t.data_ptr() for t in batch.keys + batch.values]
        cache_bytes = sum(t.numel() * t.element_size() for t in batch.keys + batch.values)
        fused_bytes = batch.fused.nbytes  # the concatenated projection weights go back too
        capture = engine.stats()["busy_graph_capture_s"]
        assert engine.stats()["kv_cache_gib"] == round(cache_bytes / 2**30, 4)
        torch.cuda.synchronize()
        free_awake, _ = torch.cuda.mem_get_info()
        engine.sleep()
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_asleep - free_awake >= cache_bytes + fused_bytes, (free_asleep - free_awake, cache_bytes)
        assert engine.stats()["kv_cache_gib"] == 0
        trainer = torch.full((free_asleep - free_awake,), 255, dtype=torch.uint8, device="cuda")  # NaN floats
        del trainer
        torch.cuda.empty_cache()
        engine.wake_up()
        tokens, outs = generate()
        assert [t.data_ptr() for t in batch.keys + batch.values] == addresses
        kept = [key for key, graph in graphs.items() if batch._graphs.get(key) is graph]
        assert kept in ([], list(graphs)), kept
        assert (engine.stats()["busy_graph_capture_s"] == capture) == bool(kept)
        assert worst_logprob_gap(model, prompts, outs) < 1e-3
        return bool(kept), tokens

    try:
        before, _ = generate()
        assert batch._graphs and batch._memory is not None, "the cache is not at stable addresses on this GPU"
        assert batch.fused is not None and batch.fused.stable
        kept, after = sleep_and_wake()
        assert after == before
        assert kept == (settled or not owns_weights), (
            "graphs that read the weights' old addresses were replayed"
        )
        if owns_weights:
            kept, again = sleep_and_wake()
            assert kept, "the weights did not come back to the addresses of the first wake"
            assert again == before
        # A longer prompt grows the cache into a new reservation: what the old one held is copied, then freed.
        reservation, length = batch._memory, batch.length
        long_prompt = [[(5 * i) % 5000 + 10 for i in range(300)]]
        grown = _complete_all(engine, long_prompt, params)
        assert batch.length > length and batch._memory is not reservation and reservation.address is None
        assert worst_logprob_gap(model, long_prompt, grown) < 1e-3
        hits = engine.stats()["prefix_cache_hits"]
        assert worst_logprob_gap(model, prompts, generate()[1]) < 1e-3  # read from the copied prefixes
        assert engine.stats()["prefix_cache_hits"] > hits
    finally:
        engine.close()


def test_a_sleep_that_discards_its_own_weights_waits_for_a_push_of_all_of_them():
    """The synchronous step pushes every weight after the update, so an engine that owns its weights (LoRA's
    merged copy) drops them at `sleep(discard_weights=True)` instead of parking them on the host: their memory
    goes back to the driver too. Woken, it generates nothing until a push has loaded every weight; a push that
    leaves one out is an error naming it; after a full push the same seeds draw the same tokens, at the
    addresses (and with the graphs) of the first wake."""
    model = load_causal_lm(SHAPE, dtype="float32", device="cuda").eval()
    engine = _engine(model, cuda_graphs=True, owns_weights=True)
    prompts = [[(13 * p + 5 * i) % 5000 + 10 for i in range(16 + 7 * p)] for p in range(3)]
    params = SamplingParams(temperature=1.0, max_tokens=16, n=2, seed=4, ignore_eos=True)
    pushed = {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def generate():
        outs = _complete_all(engine, prompts, params)
        return [o.token_ids for each in outs for o in each], outs

    def sleep_wake_push():
        torch.cuda.synchronize()
        free_awake, _ = torch.cuda.mem_get_info()
        engine.sleep(discard_weights=True)
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_asleep - free_awake >= weight_bytes, (free_asleep - free_awake, weight_bytes)
        trainer = torch.full((free_asleep - free_awake,), 255, dtype=torch.uint8, device="cuda")  # NaN floats
        del trainer
        torch.cuda.empty_cache()
        engine.wake_up()
        assert engine.is_sleeping, "woke with weights it does not hold"
        partial = {k: v for k, v in pushed.items() if k != "model.norm.weight"}
        with pytest.raises(RuntimeError, match="did not load 1 of its weights \\(model.norm.weight"):
            engine.update_weights(partial)
        assert engine.is_sleeping
        engine.update_weights(pushed)
        assert not engine.is_sleeping

    try:
        before, _ = generate()
        sleep_wake_push()
        after, outs = generate()
        assert after == before
        assert worst_logprob_gap(model, prompts, outs) < 1e-3
        capture = engine.stats()["busy_graph_capture_s"]
        sleep_wake_push()
        again, outs = generate()
        assert again == before and worst_logprob_gap(model, prompts, outs) < 1e-3
        assert engine.stats()["busy_graph_capture_s"] == capture, "the weights came back to new addresses"
    finally:
        engine.close()


def _beyond_every_free_block() -> int:
    """Bytes (at least 64 MiB) that no free block of the allocator's cache can hold, so that they take a segment
    of their own: earlier tests of the process leave segments partly in use, whose free part took a 64 MiB block
    and stayed cached after `empty_cache` (the test failed in the whole suite and passed alone)."""
    free = [
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]
    return max([64 * 2**20, *free]) + 2 * 2**20


@pytest.mark.parametrize("keep", [False, True], ids=["emptied", "kept"])
def test_a_sleep_keeps_the_allocator_cache_for_a_trainer_in_this_process_when_asked(model, keep):
    """The hybrid engine's sleep on a device no other process uses keeps what PyTorch's allocator caches: the
    trainer's next update reuses its blocks instead of allocating them again from the driver (each update
    did, ~490 cudaMalloc/cudaFree pairs with SmolLM2). By default the cache is emptied for other processes."""
    engine = _engine(model, cuda_graphs=True, owns_weights=False)
    prompts = [[(3 * p + 11 * i) % 5000 + 10 for i in range(12 + 5 * p)] for p in range(3)]
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=2, ignore_eos=True)
    try:
        _complete_all(engine, prompts, params)
        size = _beyond_every_free_block()
        block = torch.empty(size, dtype=torch.uint8, device="cuda")  # the trainer's last update
        del block
        reserved = torch.cuda.memory_reserved()
        segments = torch.cuda.memory_stats()["segment.all.allocated"]
        engine.sleep(keep_allocator_cache=keep)
        assert (torch.cuda.memory_reserved() == reserved) is keep
        block = torch.empty(size, dtype=torch.uint8, device="cuda")  # this update
        del block
        assert (torch.cuda.memory_stats()["segment.all.allocated"] == segments) is keep
        engine.wake_up()
        assert worst_logprob_gap(model, prompts, _complete_all(engine, prompts, params)) < 1e-3
    finally:
        engine.close()


def test_graphs_are_captured_with_cudnn_attention_in_a_process_that_trains_without_it():
    """A training worker turns cuDNN's attention off for the whole process (a plan for every new shape stalled
    updates 1-2 s); the engine's captures turn it back on for themselves, since a graph builds its plan once and
    decoded faster with it (5.4-5.7 s against 7.8 s for SmolLM2's 20 steps on an H200). The capture's warm-up
    runs cuDNN kernels, the switch is off again afterwards, and the bf16 engine samples what it was asked for."""
    from torch.profiler import ProfilerActivity, profile

    from agentrl.models.attention_kernels import skip_cudnn_attention

    bf16 = load_causal_lm(SHAPE, dtype="bfloat16", device="cuda").eval()
    allowed = torch.backends.cuda.cudnn_sdp_enabled()
    skip_cudnn_attention(torch.device("cuda"))
    engine = _engine(bf16, cuda_graphs=True)
    prompts = [[(7 * p + 3 * i) % 5000 + 10 for i in range(16 + 9 * p)] for p in range(4)]
    params = SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=4, ignore_eos=True)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            outs = _complete_all(engine, prompts, params)
        assert [len(o.token_ids) for group in outs for o in group] == [12] * 8
        assert engine.stats()["busy_graph_capture_s"] > 0
        kernels = [e.key for e in prof.key_averages() if "cudnn" in e.key.lower()]
        assert kernels, "the captures ran no cuDNN attention kernel"
        assert not torch.backends.cuda.cudnn_sdp_enabled(), "a capture left cuDNN's attention on"
    finally:
        engine.close()
        torch.backends.cuda.enable_cudnn_sdp(allowed)


@pytest.mark.parametrize("budget", [48, 128])
def test_a_long_prompt_prefilled_in_parts_beside_graph_decoding_is_exact(model, budget):
    """Chunked prefill under CUDA graphs: parts of 48 tokens go through the extend graphs, of 128 packed; the
    decoding row keeps its exact logprobs and the long prompt's equal teacher forcing."""
    engine = _engine(model, prefill_chunk_tokens=budget)
    short = [(7 * i + 3) % 5000 + 10 for i in range(24)]
    long = [(13 * i + 7) % 5000 + 10 for i in range(400)]
    decoding = SamplingParams(temperature=1.0, max_tokens=200, seed=2, ignore_eos=True)
    try:
        running, out = while_a_row_decodes(
            engine, short, long, decoding, SamplingParams(temperature=1.0, max_tokens=16, seed=4)
        )
        stats = engine.stats()
        assert stats["prefill_parts"] >= 400 // budget - 1
        assert stats["prefill_tokens"] == len(short) + len(long)
        assert worst_logprob_gap(model, [short, long], [[running], [out]]) < 1e-3
    finally:
        engine.close()


def test_a_prompt_copies_its_prefix_from_a_row_decoding_under_graphs_and_stays_exact(model):
    """A row decodes under CUDA graphs (steps launched ahead); a prompt sharing its first 200 tokens arrives and
    copies them out of the running row's slot: only its own 40 tokens are computed, and both rows' logprobs
    equal teacher forcing (the copy read the prompt's positions, which the decoding row never writes)."""
    engine = _engine(model)
    shared = [(11 * i + 5) % 5000 + 10 for i in range(200)]
    first = shared + [(3 * i + 1) % 5000 + 10 for i in range(24)]
    second = shared + [(5 * i + 2) % 5000 + 10 for i in range(40)]
    decoding = SamplingParams(temperature=1.0, max_tokens=200, seed=2, ignore_eos=True)
    try:
        running, out = while_a_row_decodes(
            engine, first, second, decoding, SamplingParams(temperature=1.0, max_tokens=16, seed=4)
        )
        stats = engine.stats()
        assert stats["prefix_cache_hits"] == len(shared)
        assert stats["prefill_tokens"] == len(first) + len(second) - len(shared)
        assert worst_logprob_gap(model, [first, second], [[running], [out]]) < 1e-3
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("dtype", "steps"), [("float32", 1), ("bfloat16", 1), ("float32", 4), ("bfloat16", 4)]
)
def test_agents_churning_through_the_engine_under_graphs_get_exact_answers(model, dtype, steps):
    """Twenty agents' sessions of four turns over three shared openings, through 12 slots under CUDA graphs (in
    bf16 the packed FlashAttention prefill and the split attention), turns arriving at random moments: histories
    taken over, prefixes copied from parked slots and from rows still decoding, parked histories evicted, rows
    and parked slots moved when the batch packs its rows low. Every answer's logprobs equal a teacher-forced
    forward of its whole sequence in the engine's dtype: within 1e-3 in float32, 0.1 in bf16 (0.043 on an H200),
    where 100 other tokens at the start of a 150-token history move this model's logprobs of the 40 after it by
    0.54 on average and up to 2.2 (measured on the H200), as a prefix read from the wrong slot, or stale, would.
    With 4 decode steps per engine step (one graph replay for all), rows end inside one and decode past their
    ends."""
    served = model
    if dtype == "bfloat16":
        served = load_causal_lm(SHAPE, dtype="bfloat16", device="cuda").eval()
        served.load_state_dict(model.state_dict())
    engine = _engine(served, max_num_seqs=12, num_scheduler_steps=steps)
    openings = [[(7 * i + 13 * k) % 5000 + 10 for i in range(64 + 40 * k)] for k in range(3)]

    async def session(agent):
        rng = random.Random(agent)
        prompt = openings[agent % 3] + [rng.randrange(10, 5000) for _ in range(rng.randint(5, 30))]
        done = []
        for turn in range(4):
            await asyncio.sleep(rng.random() * 0.02)
            params = SamplingParams(
                temperature=1.0, max_tokens=rng.randint(4, 40), seed=agent * 10 + turn, ignore_eos=True
            )
            out = (await engine.generate(prompt, params))[0]
            done.append((prompt, out))
            prompt = prompt + out.token_ids + [rng.randrange(10, 5000) for _ in range(rng.randint(5, 30))]
        return done

    async def run():
        return await asyncio.gather(*(session(agent) for agent in range(20)))

    try:
        answers = [pair for done in asyncio.run(run()) for pair in done]
        stats = engine.stats()
        assert stats["prefix_cache_hits"] > stats["prefix_cache_queries"] / 3, stats
        assert stats["rows_compacted"] > 0
        gap = worst_logprob_gap(served, [p for p, _ in answers], [[o] for _, o in answers])
        assert len(answers) == 80 and gap < (1e-3 if dtype == "float32" else 0.1), gap
    finally:
        engine.close()


def test_a_next_turn_after_an_image_through_the_compiled_extend_step_equals_teacher_forcing(caplog):
    """A vision-language model's next turn continues at its sequence's rotary offset (text after an image sits
    past its cache index): through the compiled extend step's graph its logprobs still equal a teacher-forced
    forward with the pixels."""
    from tests.integration.rollout.test_vision_engine import _image_prompt, _picture

    spec = "tiny:qwen2-vl"
    model = load_causal_lm(spec, dtype="float32", device="cuda").eval()
    tokenizer = load_tokenizer(spec)
    with caplog.at_level("WARNING", logger=_slot_batch.__name__):
        engine = EmbeddedEngine(model, tokenizer, max_num_seqs=8, max_model_len=256, compile_decode=True)
    try:
        first, images = _image_prompt(engine, tokenizer, _picture("purple", (100, 70)), "Name the shape.")
        params = SamplingParams(temperature=1.0, max_tokens=10, seed=11, ignore_eos=True)
        turn_1 = asyncio.run(engine.generate(first, params, images=images))[0]
        words = tokenizer.encode(" and what else is there", add_special_tokens=False)[:6]
        second = first + turn_1.token_ids + words
        turn_2 = asyncio.run(engine.generate(second, params, images=images))[0]
        assert engine.stats()["prefill_extend_tokens"] == len(words) + 1  # turn 1's last token and the words
        assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
        ids = torch.tensor([second + turn_2.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                pixel_values=images.pixel_values.cuda(),
                image_grid_thw=images.image_grid_thw.cuda(),
                mm_token_type_ids=(ids == model.config.image_token_id).int(),
            ).logits[0, len(second) - 1 : -1]
        sampled = torch.tensor(turn_2.token_ids, device="cuda")[:, None]
        expected = torch.log_softmax(logits.float(), -1).gather(1, sampled)[:, 0].cpu()
        assert torch.allclose(torch.tensor(turn_2.logprobs), expected, atol=1e-3), (turn_2.logprobs, expected)
    finally:
        engine.close()


def test_the_flash_extend_step_is_as_exact_as_the_padded_extend_step_in_bfloat16(model):
    """Next turns over cached histories in bf16, through `flash_extend_step` (packed, FlashAttention reading the
    cache in place) and through `extend_step` (padded rows, gathered slots, SDPA with a mask) on copies of one
    cache: against a float32 forward of each whole sequence, the flash step's logits are no further off than
    the padded step's (within bf16 rounding of each other), and both write the same keys and values (to bf16 rounding carried through the layers)."""
    from agentrl.rollout.engines._flash_extend import (
        WIDTH,
        flash_extend_step,
        flash_sequences,
        packed_rows,
    )
    from agentrl.rollout.engines._slot_decode import KVShape, extend_step, prefill_slots
    from agentrl.rollout.engines.flash_attention import FlashRows, flash_cache_attention_supported

    bf16 = load_causal_lm(SHAPE, dtype="bfloat16", device="cuda").eval()
    bf16.load_state_dict(model.state_dict())
    device, shape, length = torch.device("cuda"), KVShape.of(bf16), 1024
    assert flash_cache_attention_supported(device, torch.bfloat16)
    size = (16, shape.kv_heads, length, shape.head_dim)
    keys = [torch.zeros(size, dtype=torch.bfloat16, device=device) for _ in range(shape.layers)]
    values = [torch.zeros_like(k) for k in keys]
    generator = torch.Generator().manual_seed(0)
    histories = [
        torch.randint(10, 5000, (n,), generator=generator).tolist() for n in (300, 517, 811, 129, 640)
    ]
    turns = [torch.randint(10, 5000, (n,), generator=generator).tolist() for n in (37, 64, 12, 50, 1)]
    slots = [3, 0, 9, 15, 7]
    prefill_slots(bf16, keys, values, slots, [0] * 5, histories)
    padded_keys, padded_values = [k.clone() for k in keys], [v.clone() for v in values]

    tokens = torch.zeros(5, WIDTH, dtype=torch.long)
    positions = torch.full((5, WIDTH), length - 1)
    for i, (history, turn) in enumerate(zip(histories, turns, strict=True)):
        tokens[i, : len(turn)] = torch.tensor(turn)
        positions[i, : len(turn)] = torch.arange(len(history), len(history) + len(turn))
    last = torch.tensor([len(t) - 1 for t in turns])
    padded = extend_step(
        bf16, padded_keys, padded_values, torch.tensor(slots, device=device), tokens.to(device),
        positions.to(device), last.to(device), span=length,
    )  # fmt: skip

    runs = [(s, len(h), t) for s, h, t in zip(slots, histories, turns, strict=True)]
    total, bucket = 256, 8
    inputs, sequences = packed_rows(runs, total, bucket, shape.kv_heads, length, length - 1)
    count = flash_sequences(total, bucket)
    where = FlashRows.empty(count, WIDTH, length, device)
    where.fill_(sequences.to(device))
    ids, flat_positions, token_slots, flat_last = inputs.to(device).split([total, total, total, bucket])
    shaped = (t.view(-1, WIDTH) for t in (token_slots, ids, flat_positions))
    flash = flash_extend_step(bf16, keys, values, *shaped, flat_last, where)[:5]

    for i, (history, turn) in enumerate(zip(histories, turns, strict=True)):
        with torch.no_grad():
            reference = model(torch.tensor([history + turn], device=device)).logits[0, -1]
        flash_error = (flash[i].float() - reference).abs().max().item()
        padded_error = (padded[i].float() - reference).abs().max().item()
        assert flash_error <= 1.5 * padded_error + 0.05, (i, flash_error, padded_error)
        at = torch.arange(len(history), len(history) + len(turn), device=device)
        for mine, theirs in zip((*keys, *values), (*padded_keys, *padded_values), strict=True):
            apart = (mine[slots[i], :, at].float() - theirs[slots[i], :, at].float()).norm()
            assert apart <= 3e-2 * theirs[slots[i], :, at].float().norm(), (i, apart)
    assert not any(cache.isnan().any() for cache in keys + values)


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_first_turns_longer_than_a_flash_sequence_and_a_next_turn_are_exact_in_bfloat16(model, cuda_graphs):
    """Every text prompt goes through `flash_extend_step`: first turns of 300 and 150 tokens (cut into
    sequences of at most 64) and a 40-token next turn over a parked history, at most 128 tokens a forward (the
    300-token prompt continues over three forwards), under CUDA graphs and without (`enforce_eager`). Against a
    float32 forward of each whole sequence, the last logits are no further off than a plain bf16 forward's of
    the same sequence (within bf16 rounding carried through the layers)."""
    from agentrl.rollout.engines._slot_batch import SlotBatch

    bf16 = load_causal_lm(SHAPE, dtype="bfloat16", device="cuda").eval()
    bf16.load_state_dict(model.state_dict())
    batch = SlotBatch(
        bf16, max_slots=8, max_model_len=1024, cuda_graphs=cuda_graphs, prefill_chunk_tokens=128
    )
    assert batch._flash_step is not None
    generator = torch.Generator().manual_seed(5)
    history = torch.randint(10, 5000, (200,), generator=generator).tolist()
    batch.admit([history], [1], reserve=512)
    batch.keep([], finished={0: history})
    prompts = [torch.randint(10, 5000, (n,), generator=generator).tolist() for n in (300, 150)]
    prompts.append(history + torch.randint(10, 5000, (40,), generator=generator).tolist())
    packed = batch.counters["packed_forwards"]
    logits = batch.admit(prompts, [1, 1, 1], reserve=512)
    assert batch.counters["packed_forwards"] == packed  # nothing through the eager packed forward
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            reference = model(ids).logits[0, -1]
            plain = bf16(ids).logits[0, -1].float()
        error = (logits[i].float() - reference).abs().max().item()
        plain_error = (plain - reference).abs().max().item()
        assert error <= 1.5 * plain_error + 0.05, (i, error, plain_error)
