"""The slot cache's forwards (packed prefill, fixed-width extend, packed FlashAttention extend, one-token decode)
give the logits of a plain forward of the whole sequence, each continuing where the one before left its keys and
values. The CPU engine extends through the packed prefill, so `extend_step` (the CUDA-graph path) is checked here
on the CPU, and `flash_extend_step` with a reference of FlashAttention's varlen kernel in its place (the kernel
itself runs only on a GPU: tests/gpu/test_slot_engine.py)."""

import pytest
import torch

from agentrl.rollout.engines import _slot_decode, flash_attention
from agentrl.rollout.engines._flash_extend import (
    WIDTH,
    flash_extend_step,
    flash_sequences,
    packed_rows,
)
from agentrl.rollout.engines._slot_batch import weight_layout
from agentrl.rollout.engines._slot_decode import (
    KVShape,
    _rotate,
    decode_attention,
    decode_step,
    extend_step,
    prefill_slots,
)
from agentrl.rollout.engines.flash_attention import FlashRows
from tests._random_qwen2 import random_qwen2

SLOTS, LENGTH = 4, 64


@pytest.fixture(scope="module")
def model():
    return random_qwen2(vocab_size=80)


def _cache(model):
    shape = KVShape.of(model)
    size = (SLOTS, shape.kv_heads, LENGTH, shape.head_dim)
    return [torch.zeros(size) for _ in range(shape.layers)], [torch.zeros(size) for _ in range(shape.layers)]


def _reference(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def reference_varlen_kernel(q, k, v, rows: FlashRows, scale: float) -> torch.Tensor:
    """FlashAttention's varlen forward as documented, in plain torch: sequence i's queries q[cu_q[i]:cu_q[i+1]]
    over keys k[cu_k[i]:cu_k[i]+seqused[i]], causal from the bottom right (the last query sees every key), the
    query heads sharing the kv heads in groups. Rows no sequence covers stay NaN."""
    out = torch.full_like(q, float("nan"))
    groups = q.shape[1] // k.shape[1]
    cu_q, cu_k, used = rows.cu_q.tolist(), rows.cu_k.tolist(), rows.seqused.tolist()
    assert max(cu_q[i + 1] - cu_q[i] for i in range(len(used))) <= rows.max_q
    for i, n in enumerate(used):
        queries = q[cu_q[i] : cu_q[i + 1]]
        m = queries.shape[0]
        if m == 0:
            continue
        keys = k[cu_k[i] : cu_k[i] + n].repeat_interleave(groups, dim=1)
        values = v[cu_k[i] : cu_k[i] + n].repeat_interleave(groups, dim=1)
        scores = torch.einsum("mhd,nhd->hmn", queries, keys) * scale
        seen = torch.arange(n)[None, :] <= torch.arange(m)[:, None] + (n - m)
        weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[cu_q[i] : cu_q[i + 1]] = torch.einsum("hmn,nhd->mhd", weights, values)
    return out


def reference_rotary_write(qkv, biases, cos, sin, cache_rows, keys, values, heads: int) -> torch.Tensor:
    """`rotary_write.rotary_write` as documented, in plain torch: the projections' biases added and queries and
    keys rotated in float32, rounded once; keys and values written at `cache_rows`; the queries (tokens, heads, D)."""
    tokens, head_dim, kv_heads = qkv.shape[0], keys.shape[-1], keys.shape[1]
    parts = list(qkv.float().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    if biases is not None:
        parts = [part + bias.float() for part, bias in zip(parts, biases, strict=True)]
    wide_cos, wide_sin = cos.float()[:, None], sin.float()[:, None]
    q = _rotate(parts[0].view(tokens, heads, head_dim), wide_cos, wide_sin).to(qkv.dtype)
    k = _rotate(parts[1].view(tokens, kv_heads, head_dim), wide_cos, wide_sin).to(keys.dtype)
    keys.view(-1, head_dim).index_copy_(0, cache_rows, k.reshape(-1, head_dim))
    values.view(-1, head_dim).index_copy_(0, cache_rows, parts[2].to(values.dtype).reshape(-1, head_dim))
    return q


def _flash_forward(model, keys, values, runs: list[tuple[int, int, list[int]]]) -> torch.Tensor:
    """`flash_extend_step` over `runs` (slot, first position, tokens) as the engine packs them, with one row more
    than the runs (an empty sequence) and 3 x WIDTH tokens (the padding in three sequences); the runs' logits."""
    bucket, total = len(runs) + 1, 3 * WIDTH
    inputs, sequences = packed_rows(runs, total, bucket, KVShape.of(model).kv_heads, LENGTH, LENGTH - 1)
    where = FlashRows.empty(flash_sequences(total, bucket), WIDTH, LENGTH, torch.device("cpu"))
    where.fill_(sequences)
    ids, positions, token_slots, last = inputs.split([total, total, total, bucket])
    shaped = (t.view(-1, WIDTH) for t in (token_slots, ids, positions))
    return flash_extend_step(model, keys, values, *shaped, last, where)[: len(runs)]


@pytest.mark.parametrize("extend_with", ["extend_step", "prefill_slots", "flash_extend_step"])
def test_prefill_then_extend_then_decode_equal_one_forward(model, extend_with, monkeypatch):
    torch.manual_seed(1)
    rows = [torch.randint(0, 80, (n,)).tolist() for n in (30, 17, 24)]
    slots, head, more = [2, 0, 3], [12, 5, 9], 6  # prompt head, then `more` tokens, then decode the rest
    keys, values = _cache(model)
    first = prefill_slots(
        model, keys, values, slots, [0, 0, 0], [r[:h] for r, h in zip(rows, head, strict=True)]
    )
    chunks = [r[h : h + more] for r, h in zip(rows, head, strict=True)]
    if extend_with == "extend_step":
        width = 8  # wider than the chunks: padding tokens sit at the sink, the slot's last position
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.full((len(rows), width), LENGTH - 1)
        for i, (chunk, h) in enumerate(zip(chunks, head, strict=True)):
            tokens[i, :more], positions[i, :more] = torch.tensor(chunk), torch.arange(h, h + more)
        last = torch.full((len(rows),), more - 1)
        second = extend_step(model, keys, values, torch.tensor(slots), tokens, positions, last, span=LENGTH)
    elif extend_with == "flash_extend_step":
        monkeypatch.setattr(flash_attention, "varlen_kernel", reference_varlen_kernel)
        second = _flash_forward(model, keys, values, list(zip(slots, head, chunks, strict=True)))
        assert not any(cache.isnan().any() for cache in (*keys, *values))  # the padding's rows were computed
    else:
        second = prefill_slots(model, keys, values, slots, head, chunks)
    for i, row in enumerate(rows):
        reference = _reference(model, row)
        torch.testing.assert_close(first[i], reference[head[i] - 1], atol=1e-5, rtol=0)
        torch.testing.assert_close(second[i], reference[head[i] + more - 1], atol=1e-5, rtol=0)

    # decode_step feeds row i in slot i: move each row's cache to the slot of its index
    order = torch.tensor(slots)
    for cache in (*keys, *values):
        cache[: len(rows)] = cache[order].clone()
    at = [h + more for h in head]
    for step in range(5):
        ids = torch.tensor([row[a + step] for row, a in zip(rows, at, strict=True)])
        positions = torch.tensor([a + step for a in at])
        logits = decode_step(model, keys, values, ids, positions, span=max(at) + step + 1)
        for i, row in enumerate(rows):
            torch.testing.assert_close(logits[i], _reference(model, row)[at[i] + step], atol=1e-5, rtol=0)


@pytest.mark.parametrize("forward", ["prefill_slots", "flash_extend_step"])
def test_a_prefills_last_layer_computes_only_each_rows_last_token(model, forward, monkeypatch):
    """Its keys and values are written for every token (the decode steps after it read them), the rest only for
    the token whose logits come out: the same logits and cache as the whole layer, its MLP over one token a row
    (the flash forward's rows include its padding row)."""
    monkeypatch.setattr(flash_attention, "varlen_kernel", reference_varlen_kernel)
    torch.manual_seed(3)
    slots, starts = [1, 3, 0], [4, 0, 9]
    prompts = [
        torch.randint(0, 80, (start + n,)).tolist() for start, n in zip(starts, (7, 3, 5), strict=True)
    ]
    mlp_rows: list[int] = []
    hook = model.model.layers[-1].mlp.register_forward_pre_hook(
        lambda _, args: mlp_rows.append(args[0].shape[:-1].numel())
    )
    logits, caches, rows_seen = {}, {}, {}
    try:
        for trim in (True, False):
            monkeypatch.setattr(_slot_decode, "TRIM_LAST_LAYER", trim)
            keys, values = _cache(model)
            heads = [p[:s] for p, s in zip(prompts, starts, strict=True) if s]
            prefill_slots(model, keys, values, [1, 0], [0, 0], heads)  # the cached parts first
            mlp_rows.clear()
            chunks = [p[s:] for p, s in zip(prompts, starts, strict=True)]
            if forward == "prefill_slots":
                logits[trim] = prefill_slots(model, keys, values, slots, starts, chunks)
            else:
                logits[trim] = _flash_forward(
                    model, keys, values, list(zip(slots, starts, chunks, strict=True))
                )
            caches[trim], rows_seen[trim] = keys + values, mlp_rows[:]
    finally:
        hook.remove()
    last_tokens, every_token = (3, 15) if forward == "prefill_slots" else (4, 3 * WIDTH)
    assert (rows_seen[True], rows_seen[False]) == ([last_tokens], [every_token])
    torch.testing.assert_close(logits[True], logits[False], atol=1e-6, rtol=0)
    for trimmed_cache, whole_cache in zip(caches[True], caches[False], strict=True):
        torch.testing.assert_close(trimmed_cache, whole_cache, atol=0, rtol=0)
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[True][i], _reference(model, prompt)[-1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("lengths", [[150, 1, 64], [64, 65, 127, 128, 129], [3] * 9, [300]])
def test_packed_rows_cut_every_row_into_sequences_of_at_most_width_within_the_bucket(lengths):
    """Rows of any length are cut into consecutive sequences of at most `WIDTH` tokens of one slot, each reading
    its slot up to its own last token; they and the padding's fit `flash_sequences` whatever the lengths."""
    import random

    from agentrl.rollout.engines._slot_batch import _token_bucket

    rng = random.Random(len(lengths))
    runs = [(slot, rng.randint(0, 40), [7] * n) for slot, n in enumerate(lengths)]
    tokens, rows, length = _token_bucket(sum(lengths)), 16, 512
    inputs, sequences = packed_rows(runs, tokens, rows, 1, length, length - 1)
    count = flash_sequences(tokens, rows)
    cu_q, cu_k, used = sequences.split([count + 1, count + 1, count])
    sizes = (cu_q[1:] - cu_q[:-1]).tolist()
    assert cu_q[-1] == tokens and max(sizes) <= WIDTH and min(sizes) >= 0
    covered = []  # (slot, position) each real query reads up to, in packing order
    for i, n in enumerate(sizes):
        covered += [(cu_k[i].item() // length, used[i].item() - n + j) for j in range(n)]
    positions = inputs[tokens : 2 * tokens].tolist()
    slots = inputs[2 * tokens : 3 * tokens].tolist()
    real = sum(lengths)
    assert covered[:real] == list(zip(slots[:real], positions[:real], strict=True))
    last = inputs[3 * tokens :].tolist()
    assert last[: len(runs)] == [sum(lengths[: i + 1]) - 1 for i in range(len(runs))]
    with pytest.raises(ValueError, match="do not fit"):
        packed_rows(runs, tokens, len(runs) - 1, 1, length, length - 1)
    with pytest.raises(ValueError, match="do not fit"):
        packed_rows(runs, real - 1, rows, 1, length, length - 1)
    with pytest.raises(ValueError, match="row 1 has no tokens"):
        packed_rows([runs[0], (5, 3, [])], tokens, rows, 1, length, length - 1)


@pytest.mark.parametrize("rotary", ["projections", "rotary_write"])
def test_the_flash_path_prefills_prompts_longer_than_a_forward_across_forwards_exactly(
    model, monkeypatch, rotary
):
    """Every text prompt goes through `flash_extend_step` (run here without graphs, the kernel's reference in
    place): first turns of 150 and 70 tokens, a next turn over a cached history, with at most 64 tokens a
    forward (`prefill_chunk_tokens`), so the long ones continue over what the forwards before wrote; each
    prompt's last logits equal a plain forward of it, and prefill counts every token once. Both ways a layer
    reaches the attention: the model's projections and indexed writes, and (as on a GPU) one multiply over the
    concatenated weights into `rotary_write` (its reference here; the kernel itself: tests/gpu)."""
    from agentrl.rollout.engines import _flash_extend
    from agentrl.rollout.engines._slot_batch import SlotBatch

    monkeypatch.setattr(flash_attention, "varlen_kernel", reference_varlen_kernel)
    if rotary == "rotary_write":
        monkeypatch.setattr(_flash_extend, "rotary_write_takes", lambda attn, head_dim, device: True)
        monkeypatch.setattr(_flash_extend, "rotary_write", reference_rotary_write)
    torch.manual_seed(4)
    batch = SlotBatch(model, max_slots=8, max_model_len=512, cuda_graphs=False, prefill_chunk_tokens=64)
    batch._flash_step = flash_extend_step  # what a GPU with FlashAttention's `seqused_k` gets
    history = torch.randint(0, 80, (40,)).tolist()
    batch.admit([history], [1], reserve=64)
    batch.keep([], finished={0: history})
    prompts = [torch.randint(0, 80, (n,)).tolist() for n in (150, 70)] + [history + [3, 4, 5]]
    forwards = batch.counters["extend_forwards"]
    logits = batch.admit(prompts, [1, 1, 1], reserve=256)
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[i], _reference(model, prompt)[-1], atol=1e-5, rtol=0)
    assert batch.counters["extend_forwards"] - forwards == 4  # 150 + 70 + 3 tokens, 64 a forward
    assert batch.counters["extend_tokens"] == 40 + 150 + 70 + 3 and batch.counters["packed_forwards"] == 0


@pytest.mark.parametrize("spec", ["tiny:qwen2-vl"])
def test_an_unmixed_mrope_rotary_is_mixed_as_older_transformers_attention_does(monkeypatch, spec):
    """transformers 5.17 (the GPU image's) returns Qwen2-VL's rotary cos/sin per mrope component, (3, ..., D),
    and mixes them in the attention; 5.24 mixes them in the rotary. `_rotary` gives the same mixed (..., D)
    either way, for text positions and for an image prompt's distinct (t, h, w) positions."""
    from agentrl.models import load_causal_lm
    from agentrl.rollout.engines._slot_decode import _rotary, text_model

    model = load_causal_lm(spec)
    hidden = torch.zeros(2, 5, text_model(model).embed_tokens.embedding_dim)
    text = torch.arange(10).view(2, 5)
    image = torch.stack([torch.arange(5), torch.tensor([0, 1, 1, 2, 3]), torch.tensor([0, 1, 2, 2, 4])]).view(
        3, 1, 5
    )
    expected = [_rotary(model, hidden, text), _rotary(model, hidden[:1], image)]
    rotary = type(text_model(model).rotary_emb)
    monkeypatch.setattr(
        rotary, "recomposition_frequencies", lambda _self, freqs: torch.cat((freqs, freqs), dim=-1)
    )
    assert text_model(model).rotary_emb(hidden, text.expand(3, 2, 5))[0].shape == (
        3,
        2,
        5,
        model.config.text_config.hidden_size // model.config.text_config.num_attention_heads,
    )
    got = [_rotary(model, hidden, text), _rotary(model, hidden[:1], image)]
    for (cos, sin), (want_cos, want_sin) in zip(got, expected, strict=True):
        torch.testing.assert_close(cos, want_cos)
        torch.testing.assert_close(sin, want_sin)
    as_text = _rotary(model, hidden[:1], torch.arange(5).view(1, 5))[0]
    assert not torch.allclose(
        expected[1][0], as_text
    )  # the image's (t, h, w) positions really differ from text


def test_weight_layout_changes_only_when_a_weight_moves():
    """What decides whether the engine's CUDA graphs survive a weight update: an in-place write keeps the
    layout, a tensor given new memory (or a new shape) changes it."""
    model = random_qwen2(vocab_size=80)
    before = weight_layout(model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    assert weight_layout(model) == before
    layer = model.model.layers[0].mlp.up_proj
    layer.weight.data = layer.weight.data.clone()
    assert weight_layout(model) != before


def _counting_batch(model, max_slots: int):
    """An eager `SlotBatch` and the list its decode steps append their computed row counts to."""
    from agentrl.rollout.engines._slot_batch import SlotBatch

    batch = SlotBatch(model, max_slots=max_slots, max_model_len=128, cuda_graphs=False)
    computed: list[int] = []

    def recording(*args, **kwargs):
        computed.append(args[3].shape[0])  # token_ids: one per computed row
        return decode_step(*args, **kwargs)

    batch._decode_step = recording
    return batch, computed


def test_an_eager_decode_step_computes_the_rows_in_use_rounded_up_to_eight(model):
    """Without CUDA graphs a step computes up to the highest slot in use rounded up to 8, not a power of two
    (33 rows computed 64, twice the work); the logits of the rows in use are the same either way."""
    batch, computed = _counting_batch(model, max_slots=64)
    prompts = [[5 + i % 7, 6, 7] for i in range(33)]
    batch.admit(prompts, [1] * 33, reserve=8)
    logits = batch.decode([11] * batch.size)
    assert computed == [40] and logits.shape[0] == 33
    tokens = prompts[32] + [11]
    assert torch.allclose(logits[32], _reference(model, tokens)[-1], atol=1e-4)


def test_the_engine_extends_next_turns_of_different_lengths_as_one_forward_of_each_whole_sequence(model):
    """`SlotBatch._extend` (an agent's next turns over their cached histories, the CUDA-graph path, run here
    without graphs): its rows, their padding to the width and the bucket's padding rows are built from Python
    lists; each turn's last logits equal a plain forward of its whole sequence."""
    from agentrl.rollout.engines._slot_batch import SlotBatch

    torch.manual_seed(2)
    histories = [torch.randint(0, 80, (n,)).tolist() for n in (20, 9, 31)]
    turns = [torch.randint(0, 80, (n,)).tolist() for n in (5, 16, 1)]
    batch = SlotBatch(model, max_slots=16, max_model_len=128, cuda_graphs=False)
    batch.admit(histories, [1, 1, 1], reserve=64)
    slots = list(batch._row_slots)
    plan = {i: (slots[i], len(histories[i])) for i in range(3)}
    logits = batch._extend(plan, dict(enumerate(turns)), {i: 0 for i in range(3)})
    for i in range(3):
        reference = _reference(model, histories[i] + turns[i])[-1]
        torch.testing.assert_close(logits[i], reference, atol=1e-5, rtol=0)


def test_rows_left_in_high_slots_move_low_and_a_prefix_parked_low_moves_up_intact(model):
    """When few rows remain in high slots (a GRPO step's slowest answers), the next decode step swaps them into
    the lowest slots that run nothing, so it computes 8 rows instead of 24; the rows' logits stay those of a
    plain forward, and the prefix parked in a low slot moves up with its keys and values: a prompt extending it
    still finds it and computes only its new tokens, exactly."""
    torch.manual_seed(3)
    prompts = [torch.randint(0, 80, (n,)).tolist() for n in range(18, 38)]  # 20 rows, slots 0..19
    fed = [[int(t) for t in torch.randint(0, 80, (2,))] for _ in prompts]
    batch, computed = _counting_batch(model, max_slots=32)
    batch.admit(prompts, [1] * len(prompts), reserve=64)
    assert batch._row_slots == list(range(20))
    for step in range(2):
        batch.decode([tokens[step] for tokens in fed])
    sequences = [p + f for p, f in zip(prompts, fed, strict=True)]
    # row 0 finishes and parks slot 0; rows 17 and 19 keep running; the rest are freed
    batch.keep([17, 19], finished={0: sequences[0]})
    logits = batch.decode([5, 6])
    assert computed[-1] == 8 and sorted(batch._row_slots) == [0, 1]
    assert batch.counters["compacted_rows"] == 2
    for row, token, got in zip((17, 19), (5, 6), logits, strict=True):
        torch.testing.assert_close(got, _reference(model, sequences[row] + [token])[-1], atol=1e-5, rtol=0)

    hits = batch.counters["prefix_hit_tokens"]
    turn = sequences[0] + [7, 8, 9]
    first = batch.admit([turn], [1], reserve=64)
    assert batch.counters["prefix_hit_tokens"] - hits == len(sequences[0])
    torch.testing.assert_close(first[0], _reference(model, turn)[-1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("groups", [1, 2, 7])
def test_the_cpu_decode_attention_equals_scaled_dot_product_attention(groups):
    """The CPU decode step attends with two matrix products (faster there at a few query rows a kv head): over
    a strided view of the cache, rows of different lengths masked, it gives what SDPA gives."""
    torch.manual_seed(groups)
    rows, kv_heads, length, span, head = 5, 2, 96, 70, 16
    keys, values = torch.randn(8, kv_heads, length, head), torch.randn(8, kv_heads, length, head)
    query = torch.randn(rows, kv_heads, groups, head)
    visible = (torch.arange(span) <= torch.tensor([0, 9, 33, 69, 50])[:, None])[:, None, None, :]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    cached_keys, cached_values = keys[:rows, :, :span], values[:rows, :, :span]
    got = decode_attention(query, cached_keys, cached_values, attn_mask=mask, scale=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(
        query, cached_keys, cached_values, attn_mask=mask, scale=0.3
    )
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_cpu_decode_attention_leaves_lower_precision_to_scaled_dot_product_attention():
    """In bf16 the matrix products would take the softmax in bf16, where SDPA's kernel takes it in float32: bf16
    stays on SDPA, bit for bit."""
    torch.manual_seed(3)
    query = torch.randn(4, 2, 2, 16, dtype=torch.bfloat16)
    keys, values = (torch.randn(4, 2, 16, 16, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.zeros(4, 1, 1, 16, dtype=torch.bfloat16)
    mask[1, ..., 9:] = float("-inf")
    got = decode_attention(query, keys, values, attn_mask=mask, scale=0.25)
    want = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.25)
    assert torch.equal(got, want)


def test_the_split_kernel_takes_power_of_two_head_sizes_and_leaves_the_rest_to_flash_attention():
    """The Triton kernel's blocks span a head whole, so only powers of two reach it (`flash_cache_attention`
    calls FlashAttention's kernel for the rest, e.g. Phi-3's 96)."""
    from agentrl.rollout.engines.split_attention import split_kernel_takes

    sizes = (8, 32, 48, 64, 80, 96, 128, 256, 512)
    assert [size for size in sizes if split_kernel_takes(size)] == [32, 64, 128, 256]


def test_rotary_write_takes_plain_projections_with_biases_on_all_or_none(model, monkeypatch):
    """The kernel path is taken only where it computes what the projections do: CUDA, plain linear layers with
    biases on all three or none, no per-head norm, a power-of-two head size (Triton's import faked here)."""
    import copy

    from agentrl.rollout.engines import rotary_write

    monkeypatch.setattr(rotary_write, "triton_imports", lambda: True)
    attn, cuda = model.model.layers[0].self_attn, torch.device("cuda")
    assert rotary_write.rotary_write_takes(attn, 64, cuda)
    assert not rotary_write.rotary_write_takes(attn, 64, torch.device("cpu"))
    assert not rotary_write.rotary_write_takes(attn, 96, cuda)
    unbiased_keys = copy.deepcopy(attn)
    unbiased_keys.k_proj = torch.nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features, bias=False)
    assert not rotary_write.rotary_write_takes(unbiased_keys, 64, cuda)
    normed = copy.deepcopy(attn)
    normed.q_norm = torch.nn.RMSNorm(64)
    assert not rotary_write.rotary_write_takes(normed, 64, cuda)
    adapted = copy.deepcopy(attn)
    adapted.v_proj = torch.nn.Sequential(attn.v_proj)  # any module that is not a plain nn.Linear
    assert not rotary_write.rotary_write_takes(adapted, 64, cuda)


@pytest.mark.parametrize("tokens", [1, 64, 65, 300, 576, 577, 1000, 1024, 1025, 4000])
def test_a_flash_forward_pads_its_tokens_by_at_most_a_sixteenth(tokens):
    """`_token_bucket`: a multiple of `WIDTH`, at least the tokens, padding them by less than `WIDTH` or a
    sixteenth of their power of two; 12 next turns of 48 tokens (576) are not padded at all (eighths made 640)."""
    from agentrl.rollout.engines._slot_batch import _next_power_of_two, _token_bucket

    bucket = _token_bucket(tokens)
    assert bucket % WIDTH == 0 and bucket >= tokens
    assert bucket - tokens < max(WIDTH, _next_power_of_two(tokens) // 16)
    if tokens == 576:
        assert bucket == 576
