"""Pure parts of the vLLM rollout backend: weight-folder cleanup and the flags the model config implies."""

from __future__ import annotations

from agentrl.config import load_config
from agentrl.rollout.serving.vllm import build_vllm_extra_args, remove_old_weight_folders


def test_remove_old_weight_folders_keeps_only_the_latest_and_foreign_files(tmp_path):
    for name in ("v1", "v2", "v10", "vocab", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "v1" / "model.safetensors").write_bytes(b"x")
    removed = remove_old_weight_folders(tmp_path, keep="v10")
    assert sorted(p.name for p in removed) == ["v1", "v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "v10", "vocab"]


def test_vllm_extra_args_add_tokenizer_and_remote_code_after_the_users_args(tmp_path):
    config = load_config(
        [
            'actor_rollout_ref.rollout.vllm.extra_args=[--seed,"3"]',  # quoted: Hydra reads 3 as an int
            f"actor_rollout_ref.model.tokenizer_path={tmp_path}",
            "actor_rollout_ref.model.trust_remote_code=true",
        ]
    )
    assert build_vllm_extra_args(config) == [
        "--seed",
        "3",
        "--tokenizer",
        str(tmp_path),
        "--trust-remote-code",
    ]
    assert build_vllm_extra_args(load_config([])) == []
