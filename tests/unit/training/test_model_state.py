"""`save_full_weights`: the served weights streamed to a Hugging Face folder in shards of at most `shard_bytes`,
which `AutoModelForCausalLM.from_pretrained` loads; one `model.safetensors` when they fit in one shard."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

from agentrl.training.parallel.model_state import save_full_weights
from agentrl.training.parallel.served_weights import served_state_dict
from tests._random_qwen2 import random_qwen2


def _tiny_model(tied: bool) -> Qwen2ForCausalLM:
    return random_qwen2(tied=tied)


def _weight_files(folder):
    return sorted(p.name for p in folder.iterdir() if "safetensors" in p.name)


def _assert_loads_as(folder, source: torch.nn.Module) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = served_state_dict(source)
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_a_small_shard_limit_writes_several_shards_and_an_index(tmp_path):
    model = _tiny_model(tied=False)
    save_full_weights(model, None, tmp_path, shard_bytes=16 * 1024)

    files = _weight_files(tmp_path)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors" not in files
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    state = model.state_dict()
    assert index["weight_map"].keys() == state.keys()  # untied: lm_head is written
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    for shard in shards:
        written = load_file(tmp_path / shard)
        assert {index["weight_map"][name] for name in written} == {shard}
        # a shard passes the limit only when it is one tensor bigger than the limit
        size = sum(t.numel() * t.element_size() for t in written.values())
        assert size <= 16 * 1024 or len(written) == 1
    _assert_loads_as(tmp_path, model)


def test_weights_within_one_shard_keep_one_model_safetensors(tmp_path):
    model = _tiny_model(tied=True)
    save_full_weights(model, None, tmp_path)

    assert _weight_files(tmp_path) == ["model.safetensors"]
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")  # tied: not written
    _assert_loads_as(tmp_path, model)


def test_a_new_export_replaces_the_weight_files_of_an_earlier_one(tmp_path):
    model = _tiny_model(tied=False)
    save_full_weights(model, None, tmp_path)
    save_full_weights(model, None, tmp_path, shard_bytes=16 * 1024)
    assert "model.safetensors" not in _weight_files(tmp_path)  # would shadow the index on load
    save_full_weights(model, None, tmp_path)
    assert _weight_files(tmp_path) == ["model.safetensors"]
    _assert_loads_as(tmp_path, model)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sharded_worker_exports_shards_that_load_as_its_weights(one_rank_group, tmp_path):
    from agentrl.config import load_config
    from agentrl.training.workers.policy_worker import PolicyWorker

    overrides = ["actor_rollout_ref.model.path=tiny:qwen2-mini", "actor_rollout_ref.model.dtype=float32"]
    worker = PolicyWorker(load_config(overrides), total_steps=1, device="cpu")
    assert worker.sharded
    folder = tmp_path / "hf_model"
    save_full_weights(worker.actor, worker.tokenizer, folder, shard_bytes=256 * 1024)

    assert len([f for f in _weight_files(folder) if f.startswith("model-")]) > 2
    assert (folder / "tokenizer_config.json").is_file()
    _assert_loads_as(folder, worker.actor)
