"""The multi-billion shape presets (Qwen2.5-3B and -7B with random weights) and their bfloat16 build path.

The real presets are never built here (7B is 15.2 GB): their configs are checked on the meta device, and the
build path they take (`_draw_weights`, weights drawn straight in bfloat16) runs on a small config.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agentrl.models import PRESETS, load_causal_lm
from agentrl.models.tiny import TinyPreset, build_tiny_model, tiny_model_dir


def _meta_model(preset: TinyPreset):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{"vocab_size": 2048, "pad_token_id": 0, "eos_token_id": 2, **preset.text})
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


@pytest.mark.parametrize(
    ("name", "params", "tied", "vocab"),
    [("qwen2.5-3b-shape", 3_085_938_688, True, 151936), ("qwen2.5-7b-shape", 7_615_616_512, False, 152064)],
)
def test_large_presets_have_the_real_models_parameter_counts(name, params, tied, vocab):
    """Qwen2.5-3B: 3.09B parameters, Qwen2.5-7B: 7.62B (the counts of the released checkpoints)."""
    preset = PRESETS[name]
    model = _meta_model(preset)
    assert sum(p.numel() for p in model.parameters()) == params  # a tied tensor counted once
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    assert model.model.embed_tokens.weight.shape[0] == vocab
    assert preset.dtype == "bfloat16"
    assert preset.text["rope_theta"] == 1e6 and preset.text["max_position_embeddings"] == 32768


def test_the_default_dtype_leaves_older_recipes_unchanged():
    """`dtype` joins the recipe only when set, so presets built before it keep their folders."""
    preset = PRESETS["qwen2-mini"]
    assert "dtype" not in preset.recipe()
    assert PRESETS["qwen2.5-7b-shape"].recipe()["dtype"] == "bfloat16"
    bf16 = TinyPreset(name=preset.name, text=preset.text, dtype="bfloat16")
    assert tiny_model_dir(bf16, 0) != tiny_model_dir(preset, 0)


_SMALL_BF16 = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2}


@pytest.mark.parametrize("tied", [True, False])
def test_bfloat16_build_draws_saves_and_loads(tmp_path, tied):
    """The large presets' build path on a small config: bfloat16 tensors saved, norms 1, biases 0, matrices
    normal(0, 0.02), the padding row 0, the head tied or not as the config says; the folder loads and trains."""
    text = {**PRESETS["qwen2.5-3b-shape"].text, **_SMALL_BF16, "tie_word_embeddings": tied}
    build_tiny_model(TinyPreset(name="bf16-test", text=text, dtype="bfloat16"), 0, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert ("lm_head.weight" in weights) is (not tied)
    assert all(torch.all(w == 1) for k, w in weights.items() if k.endswith("norm.weight"))
    assert all(torch.all(w == 0) for k, w in weights.items() if k.endswith(".bias"))
    q = weights["model.layers.0.self_attn.q_proj.weight"].float()
    assert abs(q.std().item() - 0.02) < 0.002 and abs(q.mean().item()) < 0.002
    embedding = weights["model.embed_tokens.weight"]
    pad = json.loads((tmp_path / "config.json").read_text())["pad_token_id"]
    assert embedding.shape[0] == text["vocab_size"] and torch.all(embedding[pad] == 0)

    model = load_causal_lm(str(tmp_path), dtype="bfloat16").train()
    ids = torch.tensor([[1, 100, 200, 300, 2]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(151936.0)).item()) < 1.0


def test_bfloat16_build_is_seeded_whatever_the_thread_count(tmp_path, monkeypatch):
    preset = TinyPreset(
        name="bf16-test", text={**PRESETS["qwen2.5-7b-shape"].text, **_SMALL_BF16}, dtype="bfloat16"
    )
    monkeypatch.setattr("agentrl.models.tiny._DRAW_BLOCK", 4096)  # several blocks per matrix
    build_tiny_model(preset, 0, tmp_path / "a")
    build_tiny_model(preset, 1, tmp_path / "c")
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    build_tiny_model(preset, 0, tmp_path / "b")
    a, b, c = (load_file(Path(tmp_path, f, "model.safetensors")) for f in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    up = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(a[up], c[up])
    assert not torch.equal(a[up].view(-1)[:4096], a[up].view(-1)[4096:8192])  # blocks differ
