import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agentrl.models import PRESETS, load_causal_lm, parse_tiny_spec, resolve_model_path
from agentrl.models.tiny import tiny_model_dir

EXPECTED_FILES = {
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
}


def test_parse_spec_defaults_and_seed():
    assert parse_tiny_spec("tiny:qwen2") == (PRESETS["qwen2"], 0)
    assert parse_tiny_spec("tiny:qwen2-mini@7") == (PRESETS["qwen2-mini"], 7)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("tiny:gpt5", "unknown tiny preset 'gpt5'.*qwen2-mini"), ("tiny:qwen2@x", "bad seed 'x'")],
)
def test_parse_spec_errors_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_tiny_spec(spec)


def test_non_tiny_paths_are_returned_unchanged():
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model_path("/some/local/folder") == "/some/local/folder"


def test_folder_layout_and_cache_location(model_cache, mini_path):
    path = Path(mini_path)
    assert path.parent == model_cache / "tiny"
    assert path.name.startswith("qwen2-mini-s0-")
    assert EXPECTED_FILES <= set(os.listdir(path))
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]  # no half-built folder left
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0] and generation["pad_token_id"] == 0


def test_second_resolve_reuses_the_cache(mini_path):
    mtime = os.path.getmtime(Path(mini_path) / "model.safetensors")
    assert resolve_model_path("tiny:qwen2-mini") == mini_path
    assert resolve_model_path("tiny:qwen2-mini@0") == mini_path
    assert os.path.getmtime(Path(mini_path) / "model.safetensors") == mtime


@pytest.mark.parametrize(("preset", "layers", "hidden"), [("qwen2", 4, 128), ("qwen2-mini", 2, 64)])
def test_preset_configs(model_cache, preset, layers, hidden):
    config = json.loads((Path(resolve_model_path(f"tiny:{preset}")) / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (layers, hidden)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is True and config["max_position_embeddings"] == 1024
    assert config["vocab_size"] == 2048 and config["eos_token_id"] == 2 and config["dtype"] == "float32"


def test_same_seed_same_weights_other_seed_differs(model_cache, tmp_path, monkeypatch, mini_path):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))  # rebuild from scratch in another cache
    rebuilt = resolve_model_path("tiny:qwen2-mini")
    other = resolve_model_path("tiny:qwen2-mini@1")
    a, b, c = (load_file(f"{p}/model.safetensors") for p in (mini_path, rebuilt, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith("q_proj.weight"))
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (
            Path(mini_path, name).read_text()
            == Path(rebuilt, name).read_text()
            == Path(other, name).read_text()
        )


def test_concurrent_builders_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model_path("tiny:qwen2-mini@3")))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == [Path(results[0]).name]
    assert Path(results[0], "model.safetensors").exists()


def test_recipe_change_changes_the_folder():
    preset = PRESETS["qwen2-mini"]
    changed = type(preset)(name=preset.name, text={**preset.text, "num_hidden_layers": 3})
    assert tiny_model_dir(preset, 0) != tiny_model_dir(changed, 0)
    assert tiny_model_dir(preset, 0) != tiny_model_dir(preset, 1)


def test_build_takes_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    start = time.perf_counter()
    resolve_model_path("tiny:qwen2")
    assert time.perf_counter() - start < 20


@pytest.mark.parametrize("fixture", ["mini_path", "qwen2_path"])
def test_generate_and_backward(request, fixture):
    model = load_causal_lm(request.getfixturevalue(fixture))
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    prompt = torch.tensor([[1, 100, 200, 300, 2, 1]])
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, min_new_tokens=6
    )
    assert out.shape == (1, 12) and torch.equal(out[:, :6], prompt)
    model.train()
    loss = model(input_ids=out, labels=out).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert abs(loss.item() - torch.log(torch.tensor(2048.0)).item()) < 1.0  # near-uniform at init
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_qwen2_vl_2b_shape_preset_has_the_real_model_shape():
    """The GPU preset is Qwen2-VL-2B's architecture (2.2B parameters); built on the meta device, no memory."""
    from agentrl.models import tokenizer as tok_lib
    from agentrl.models.tiny import PRESETS, _build_qwen2_vl

    preset = PRESETS["qwen2-vl-2b-shape"]
    tokenizer = tok_lib.build_tokenizer(vocab_size=preset.vocab_size)
    ids = {t: tokenizer.token_to_id(t) for t in tok_lib.SPECIAL_TOKENS}
    common = {
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": None,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }
    with torch.device("meta"):
        model = _build_qwen2_vl(preset, common, ids)
    params = sum(p.numel() for p in model.parameters())
    assert 2.1e9 < params < 2.3e9, params
    assert model.config.text_config.vocab_size == 151936
    assert model.config.vision_config.depth == 32
    assert model.config.text_config.rope_scaling["mrope_section"] == [16, 24, 24]
