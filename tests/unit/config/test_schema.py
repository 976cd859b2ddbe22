"""Schema: field bounds and choices name the key, derived defaults, estimator names, docstrings."""

from __future__ import annotations

import sys
import types

import pytest
from pydantic import BaseModel

from agentrl.config import AgentRLConfig, validate_config
from agentrl.config.problems import schema_keys
from agentrl.config.schema import BUILTIN_ADVANTAGE_ESTIMATORS


def _all_models(model: type[BaseModel]) -> list[type[BaseModel]]:
    out = [model]
    for field in model.model_fields.values():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out += _all_models(field.annotation)
    return out


def test_every_model_forbids_unknown_keys_and_every_field_has_a_docstring():
    for model in _all_models(AgentRLConfig):
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description and "\n" not in field.description, f"{model.__name__}.{name}"


def test_contract_keys_exist():
    keys = set(schema_keys())
    for key in [
        "data.train_files",
        "data.val_batch_size",
        "actor_rollout_ref.hybrid_engine",
        "actor_rollout_ref.model.target_modules",
        "actor_rollout_ref.actor.optim.betas",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
        "actor_rollout_ref.ref.fsdp_config.param_offload",
        "actor_rollout_ref.rollout.val_kwargs.do_sample",
        "actor_rollout_ref.rollout.vllm.startup_timeout",
        "critic.optim.lr",
        "critic.cliprange_value",
        "algorithm.kl_ctrl.kl_coef",
        "agent.compact_filtering.mask_error",
        "agent.stepwise_advantage.normalize_by_steps",
        "trainer.backend",
        "resource_pool_config.ref_gpus",
        "sft.max_steps",
    ]:
        assert key in keys, key


def test_defaults_and_derived_values():
    cfg = AgentRLConfig()
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert (cfg.data.train_batch_size, rollout.n, cfg.actor_rollout_ref.model.path) == (8, 4, "tiny:qwen2")
    assert actor.clip_ratio_low == actor.clip_ratio_high == 0.2
    assert rollout.max_model_len == 256 + 64
    assert cfg.critic.model.path == "tiny:qwen2"
    assert cfg.critic.optim.lr == 1e-5 and actor.optim.lr == 1e-6
    assert cfg.trainer.default_local_dir == "outputs/agentrl/default"
    assert cfg.data.train_files.endswith("agentrl/data/samples/gsm8k_train.jsonl")


def test_explicit_values_beat_derived_defaults():
    cfg = validate_config(
        {
            "actor_rollout_ref": {
                "actor": {"clip_ratio": 0.3, "clip_ratio_high": 0.28},
                "rollout": {"max_model_len": 1000},
            },
            "critic": {"model": {"path": "some/critic"}},
        }
    )
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == 0.3
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28
    assert cfg.actor_rollout_ref.rollout.max_model_len == 1000
    assert cfg.critic.model.path == "some/critic"


def test_interpolations_resolve_for_configs_built_in_python():
    cfg = AgentRLConfig(trainer={"project_name": "proj", "experiment_name": "exp"})
    assert cfg.trainer.default_local_dir == "outputs/proj/exp"


@pytest.mark.parametrize(
    ("dotted", "value", "fragment"),
    [
        ("actor_rollout_ref.model.lora_rank", -1, "greater than or equal to 0"),
        ("actor_rollout_ref.actor.clip_ratio", 0.0, "greater than 0"),
        ("actor_rollout_ref.actor.clip_ratio_low", -0.1, "greater than 0"),
        ("actor_rollout_ref.actor.clip_ratio_c", 1.0, "greater than 1"),
        ("actor_rollout_ref.rollout.gpu_memory_utilization", 1.5, "less than or equal to 1"),
        ("trainer.save_freq", 0, "-1 (never) or a positive number"),
        ("trainer.test_freq", -3, "-1 (never) or a positive number"),
        ("trainer.rollout_trace_max_episodes", 0, "a positive number of episodes or -1 (all)"),
        ("actor_rollout_ref.actor.optim.betas", [0.9, 1.0], "each beta must be in [0, 1)"),
        ("actor_rollout_ref.model.target_modules", [], "at least one module"),
        ("data.train_batch_size", "eight", "valid integer"),
        ("trainer.nnodes", 0, "greater than or equal to 1"),
        ("agent.flow", "agentrl.flow.SingleTurnChatFlow", "expected 'package.module:Name'"),
    ],
)
def test_bad_value_names_key_value_and_rule(problems_for, dotted, value, fragment):
    (message,) = problems_for({dotted: value})
    assert message.startswith(f"{dotted}={value!r} is invalid")
    assert fragment in message


def test_choice_error_lists_allowed_values_and_closest(problems_for):
    (message,) = problems_for({"actor_rollout_ref.rollout.name": "vlm"})
    assert "actor_rollout_ref.rollout.name='vlm'" in message
    assert "'embedded' or 'vllm'" in message and "did you mean 'vllm'?" in message


def test_list_entry_error_names_the_index(problems_for):
    (message,) = problems_for({"trainer.logger": ["console", "wandb"]})
    assert message.startswith("trainer.logger[1]='wandb' is invalid") and "'console' or 'mlflow'" in message


@pytest.mark.parametrize("kl_type", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_all_kl_estimator_names_are_accepted(kl_type):
    cfg = validate_config(
        {"actor_rollout_ref": {"actor": {"kl_loss_type": kl_type}}, "algorithm": {"kl_penalty": kl_type}}
    )
    assert cfg.actor_rollout_ref.actor.kl_loss_type == kl_type == cfg.algorithm.kl_penalty


@pytest.mark.parametrize("name", sorted(BUILTIN_ADVANTAGE_ESTIMATORS))
def test_builtin_estimators_validate(name):
    assert validate_config({"algorithm": {"adv_estimator": name}}).algorithm.adv_estimator == name


def test_unknown_estimator_lists_known_names_and_closest(problems_for, monkeypatch):
    fake = types.ModuleType("agentrl.algorithms.advantages")
    fake.ADVANTAGE_ESTIMATORS = {"grpo": None, "gae": None}
    monkeypatch.setitem(sys.modules, "agentrl.algorithms.advantages", fake)
    (message,) = problems_for({"algorithm.adv_estimator": "grpp"})
    assert message.startswith("algorithm.adv_estimator='grpp' is invalid")
    assert (
        "reinforce_plus_plus, reinforce_plus_plus_baseline, rloo" in message
        and "did you mean 'grpo'?" in message
    )


def test_estimator_registered_by_user_is_accepted(monkeypatch):
    fake = types.ModuleType("agentrl.algorithms.advantages")
    fake.ADVANTAGE_ESTIMATORS = {"my_estimator": None}
    monkeypatch.setitem(sys.modules, "agentrl.algorithms.advantages", fake)
    cfg = validate_config({"algorithm": {"adv_estimator": "my_estimator"}})
    assert cfg.algorithm.adv_estimator == "my_estimator"


def test_field_errors_are_all_reported_together(problems_for):
    problems = problems_for(
        {
            "actor_rollout_ref.model.lora_rank": -2,
            "trainer.device": "tpu",
            "agent.timeout": 0,
            "data.seed": "x",
        }
    )
    assert len(problems) == 4
    for key in ["lora_rank", "trainer.device", "agent.timeout", "data.seed"]:
        assert any(key in p for p in problems), key
