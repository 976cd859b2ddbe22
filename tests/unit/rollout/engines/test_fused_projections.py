"""The engine's concatenated projection weights (`_fused_projections.py`): steps that multiply by them give a plain
forward's logits (with and without q/k/v biases, with Qwen3's per-head norms), they are copies that follow the
modules' weights only when refreshed, give their memory back and take it again, and layers they cannot serve keep
their modules."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from agentrl.rollout.engines._fused_projections import FusedProjections, split_inner_linear, unfusable_reason
from agentrl.rollout.engines._slot_batch import SlotBatch
from agentrl.rollout.engines._slot_decode import decode_step, extend_step, prefill_slots
from tests._random_qwen2 import random_qwen2
from tests.unit.rollout.engines.test_slot_steps import LENGTH, _cache, _reference

SMALL = {
    "vocab_size": 80,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "qwen2":  # biases on q, k and v
        return random_qwen2(vocab_size=80)
    if family == "llama":  # no biases
        return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    return Qwen3ForCausalLM(
        Qwen3Config(**SMALL, head_dim=8)
    ).eval()  # q_norm and k_norm after the projections


def _steps(model, rows: list[list[int]], fused) -> list[torch.Tensor]:
    """Each row's logits at its last 9 positions: the packed prefill of its first tokens, an `extend_step` of 4
    more, then 4 decode steps, all multiplying by `fused` (None: the modules)."""
    keys, values = _cache(model)
    head = len(rows[0]) - 9
    out = [prefill_slots(model, keys, values, [0, 1], [0, 0], [r[:head] for r in rows], fused=fused)]
    tokens = torch.tensor([r[head : head + 4] for r in rows])
    positions = torch.arange(head, head + 4).repeat(2, 1)
    last = torch.full((2,), 3)
    out.append(
        extend_step(model, keys, values, torch.tensor([0, 1]), tokens, positions, last, LENGTH, fused=fused)
    )
    for at in range(head + 4, head + 8):
        ids, positions = torch.tensor([r[at] for r in rows]), torch.tensor([at, at])
        out.append(decode_step(model, keys, values, ids, positions, span=at + 1, fused=fused))
    return out


@pytest.mark.parametrize("down_splits", [1, 2])
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_steps_over_the_fused_weights_give_a_plain_forwards_logits(family, down_splits):
    """With `down_splits` 2 the down projection runs as two products over halves of its inputs (what CUDA takes;
    forced here on the CPU, where `down_splits_for` keeps one)."""
    model = _model(family)
    assert unfusable_reason(model.model.layers) is None
    fused = FusedProjections(model.model.layers, stable=False)
    assert (fused.layers[0].qkv_bias is None) == (family != "qwen2")
    assert {layer.down_splits for layer in fused.layers} == {1}
    layers = [layer._replace(down_splits=down_splits) for layer in fused.layers]
    rows = [torch.randint(0, 80, (20,)).tolist() for _ in range(2)]
    steps = _steps(model, rows, layers)
    for i, row in enumerate(rows):
        reference = _reference(model, row)
        expected = [reference[10], reference[14], *reference[15:19]]  # prefill, extend, four decodes
        for got, want in zip(steps, expected, strict=True):
            torch.testing.assert_close(got[i], want, atol=1e-5, rtol=0)


def test_a_product_split_over_its_inputs_equals_the_one_product():
    torch.manual_seed(0)
    x, weight = torch.randn(3, 5, 64, dtype=torch.float64), torch.randn(24, 64, dtype=torch.float64)
    for splits in (2, 4):
        torch.testing.assert_close(split_inner_linear(x, weight, splits), F.linear(x, weight))
    x, weight = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    exact = F.linear(x.double(), weight.double())
    one, split = F.linear(x, weight).double(), split_inner_linear(x, weight, 2).double()
    assert split.dtype == one.dtype and (split - exact).abs().max() <= 2 * (one - exact).abs().max()


def test_the_copies_follow_the_weights_only_when_refreshed():
    """A weight written in place (an optimizer step on the trainer's shared module, a push) reaches the steps
    once `refresh` copies it: before, they still multiply by the old copy. What `SlotBatch.weights_changed`
    does for every update path."""
    model = _model("llama")
    batch = SlotBatch(model, max_slots=2, max_model_len=64, cuda_graphs=False)
    assert batch.fused is not None and batch._fused_layers() is batch.fused.layers
    rows = [torch.randint(0, 80, (20,)).tolist() for _ in range(2)]
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
        model.model.layers[0].mlp.up_proj.weight.add_(0.1)
    stale = _steps(model, rows, batch.fused.layers)[-1]
    plain = _steps(model, rows, None)[-1]
    assert (stale - plain).abs().max() > 1e-3
    batch.weights_changed()
    torch.testing.assert_close(_steps(model, rows, batch.fused.layers)[-1], plain, atol=1e-5, rtol=0)


def test_a_release_gives_the_copies_up_and_a_refresh_makes_them_again():
    """While the engine sleeps the copies hold no memory (here the allocator's: `layers` goes; under CUDA graphs
    stable memory keeps the addresses, tests/gpu/test_slot_engine.py); the wake's refresh makes them from the
    weights as they are then."""
    model = _model("qwen2")
    batch = SlotBatch(model, max_slots=2, max_model_len=64, cuda_graphs=False)
    qkv_bytes = sum(layer.qkv.numel() * layer.qkv.element_size() for layer in batch.fused.layers)
    assert batch.fused.nbytes >= qkv_bytes > 0
    batch.release_cache()
    assert batch.fused.layers == []
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.bias.add_(0.5)
    batch.weights_changed()
    layer = model.model.layers[0].self_attn
    fused = batch.fused.layers[0]
    torch.testing.assert_close(
        fused.qkv, torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight])
    )
    torch.testing.assert_close(
        fused.qkv_bias, torch.cat([layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias])
    )


def test_layers_the_copies_cannot_serve_keep_their_modules():
    """A wrapped projection (an adapter, a quantized layer), biases on some of q/k/v only: no fused copies, and
    the reason names the layer; `fuse_projections=False` keeps none either."""

    class Wrapped(torch.nn.Linear):
        pass

    model = _model("llama")
    assert (
        SlotBatch(model, max_slots=2, max_model_len=64, cuda_graphs=False, fuse_projections=False).fused
        is None
    )
    old = model.model.layers[1].mlp.gate_proj
    model.model.layers[1].mlp.gate_proj = Wrapped(old.in_features, old.out_features, bias=False)
    assert "layer 1" in unfusable_reason(model.model.layers)
    assert FusedProjections.of(model.model.layers, stable=False) is None
    assert SlotBatch(model, max_slots=2, max_model_len=64, cuda_graphs=False).fused is None
    model = _model("llama")
    attn = model.model.layers[0].self_attn
    attn.q_proj = torch.nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features, bias=True)
    assert "layer 0" in unfusable_reason(model.model.layers)


def test_the_engines_fingerprint_names_copies_that_differ_from_the_weights(caplog):
    """A weight written in place behind the engine's back reaches the modules (and so the hash a weight sync
    compares) but not the copies the steps multiply by: the fingerprint names the stale layers instead (no
    trainer's hash matches it, so the sync fails) and says so in the log, until `mark_weights_updated`."""
    from agentrl.models import load_causal_lm, load_tokenizer
    from agentrl.rollout.engines.embedded import EmbeddedEngine

    model = load_causal_lm("tiny:qwen2-mini")
    engine = EmbeddedEngine(model, load_tokenizer("tiny:qwen2-mini"), max_num_seqs=2, max_model_len=64)
    try:
        before = engine.weights_fingerprint()
        with torch.no_grad():
            model.model.layers[1].mlp.gate_proj.weight.add_(0.01)
        assert engine.weights_fingerprint() == "stale-fused-projections(layers [1])"
        assert "fused projection weights of layers [1] differ" in caplog.text
        engine.mark_weights_updated()
        assert engine.weights_fingerprint() != before
    finally:
        engine.close()


def test_copying_on_the_cpu_leaves_no_openmp_team_in_the_callers_thread():
    """libgomp keeps a team of worker threads for every thread that starts a parallel operation, for that thread's
    life; one left in the thread that built the engine made the engine thread's decode steps twice as long on a
    2-core host (`in_passing_thread`). In a fresh process (no team yet): building the copies and checking them
    adds no OS thread to the process, where one parallel operation in the same thread does."""
    import subprocess
    import sys

    script = """
import os, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
from agentrl.rollout.engines._fused_projections import FusedProjections
torch.set_num_threads(2)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
fused = FusedProjections(model.model.layers, stable=False)
assert fused.stale_layers() == []
for _ in range(200):  # the passing threads' workers leave a moment after their thread
    if threads() == before:
        break
    time.sleep(0.01)
built = threads()
torch.ones(4_000_000).add_(1)  # a parallel operation in this thread: its team stays
print(before, built, threads())
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    before, built, after = map(int, out)
    assert built == before, (before, built)
    assert after > built, "no team appeared for a parallel operation: this host runs one OpenMP thread"
