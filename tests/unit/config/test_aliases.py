"""rLLM key names (`rllm.stepwise_advantage.*`, `rllm.rejection_sample.*`, `rllm.compact_filtering.*`) load as agent.*."""

from __future__ import annotations

import pytest

from agentrl.config import ConfigError, load_config, validate_config


def _problems(**kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    return info.value.problems


def test_an_rllm_style_override_list_loads():
    cfg = load_config(["rllm.stepwise_advantage.enable=true", "rllm.stepwise_advantage.mode=broadcast"])
    assert cfg.agent.stepwise_advantage.enable is True
    assert cfg.agent.stepwise_advantage.mode == "broadcast"


def test_every_aliased_section_reaches_its_agent_key():
    cfg = load_config(
        [
            "rllm.rejection_sample.enable=True",  # rLLM scripts write Python-style booleans
            "rllm.rejection_sample.multiplier=3",
            "+rllm.compact_filtering.enable=true",
            "++rllm.compact_filtering.mask_env_done=true",
            "actor_rollout_ref.rollout.n=4",
        ]
    )
    assert cfg.agent.rejection_sample.enable and cfg.agent.rejection_sample.multiplier == 3
    assert cfg.agent.compact_filtering.enable and cfg.agent.compact_filtering.mask_env_done


def test_alias_and_agent_key_with_different_values_is_an_error_naming_both():
    (problem,) = _problems(
        overrides=["rllm.stepwise_advantage.mode=per_step", "agent.stepwise_advantage.mode=broadcast"]
    )
    assert "'rllm.stepwise_advantage.mode=per_step'" in problem
    assert "'agent.stepwise_advantage.mode=broadcast'" in problem and "give only one" in problem


def test_alias_and_agent_key_with_the_same_value_are_accepted():
    cfg = load_config(["rllm.stepwise_advantage.enable=True", "agent.stepwise_advantage.enable=true"])
    assert cfg.agent.stepwise_advantage.enable is True


def test_rllm_keys_without_an_alias_are_refused_with_the_list_of_aliases():
    (problem,) = _problems(overrides=["rllm.workflow.use_workflow=True"])
    assert "rllm.workflow.use_workflow" in problem and "rllm.stepwise_advantage.*" in problem
    (problem,) = _problems(overrides=["rllm.stepwise_advantage.modee=per_step"])
    assert "did you mean agent.stepwise_advantage.mode?" in problem
    assert "(from override 'rllm.stepwise_advantage.modee=per_step')" in problem


def _write(tmp_path, body: str):
    path = tmp_path / "rllm_style.yaml"
    path.write_text("defaults:\n  - agent_ppo_trainer\n  - _self_\n" + body)
    return path


def test_a_config_file_with_an_rllm_section_loads(tmp_path):
    path = _write(tmp_path, "rllm:\n  stepwise_advantage:\n    enable: true\n    mode: per_step\n")
    cfg = load_config(config_path=path)
    assert (cfg.agent.stepwise_advantage.enable, cfg.agent.stepwise_advantage.mode) == (True, "per_step")
    # the command line beats the file, whichever name the file used
    cfg = load_config(["agent.stepwise_advantage.mode=broadcast"], config_path=path)
    assert cfg.agent.stepwise_advantage.mode == "broadcast"


def test_a_config_file_setting_both_names_differently_is_an_error(tmp_path):
    body = (
        "agent:\n  stepwise_advantage:\n    enable: true\n    mode: broadcast\n"
        "rllm:\n  stepwise_advantage:\n    mode: per_step\n"
    )
    (problem,) = _problems(config_path=_write(tmp_path, body))
    assert "rllm.stepwise_advantage.mode='per_step'" in problem
    assert "agent.stepwise_advantage.mode='broadcast'" in problem


def test_validate_config_reads_an_rllm_section():
    cfg = validate_config({"rllm": {"stepwise_advantage": {"enable": True}}})
    assert cfg.agent.stepwise_advantage.enable is True
    with pytest.raises(ConfigError, match="rllm.trainer.total_epochs has no agentrl alias"):
        validate_config({"rllm": {"trainer": {"total_epochs": 2}}})
