"""load_config: Hydra composition, overrides, our unknown-key errors, other config files, saving."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agentrl.config import (
    AgentRLConfig,
    ConfigError,
    config_dir,
    config_to_dict,
    load_config,
    save_resolved_config,
)
from agentrl.config.loading import CONFIG_NAME
from agentrl.config.problems import schema_keys

REPO = Path(__file__).resolve().parents[3]
MAIN_YAML = REPO / "configs" / f"{CONFIG_NAME}.yaml"


def _yaml_keys(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in node.items():
        key = f"{prefix}{name}"
        keys.append(key)
        if isinstance(value, dict):
            keys += _yaml_keys(value, key + ".")
    return keys


def test_main_yaml_is_the_one_found():
    assert config_dir() == MAIN_YAML.parent


def test_yaml_and_schema_have_the_same_keys():
    yaml_keys = _yaml_keys(yaml.safe_load(MAIN_YAML.read_text()))
    assert sorted(set(yaml_keys) - set(schema_keys())) == []  # YAML keys the schema lacks
    assert sorted(set(schema_keys()) - set(yaml_keys)) == []  # schema keys the YAML lacks
    assert yaml_keys == list(schema_keys())  # same order, so the YAML reads like the docs


def test_yaml_defaults_equal_schema_defaults():
    assert load_config() == AgentRLConfig()


def test_every_yaml_key_has_a_comment():
    for number, line in enumerate(MAIN_YAML.read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            assert " # " in line, f"{MAIN_YAML.name}:{number} has no comment: {line!r}"


def test_overrides_apply_and_interpolations_resolve():
    cfg = load_config(
        ["actor_rollout_ref.model.lora_rank=8", "trainer.project_name=proj", "trainer.logger=[console]"]
    )
    assert cfg.actor_rollout_ref.model.lora_rank == 8
    assert cfg.trainer.default_local_dir == "outputs/proj/default"
    assert cfg.trainer.logger == ["console"]
    assert cfg.data.train_files == str(REPO / "agentrl" / "data" / "samples" / "gsm8k_train.jsonl")


def test_unknown_override_keys_are_all_named_with_suggestions():
    with pytest.raises(ConfigError) as info:
        load_config(["actor_rollout_ref.modle.path=x", "trainer.total_epoch=2", "trainer.seed=3"])
    first, second = info.value.problems
    assert (
        "unknown key actor_rollout_ref.modle.path" in first
        and "did you mean actor_rollout_ref.model.path?" in first
    )
    assert "trainer.total_epoch" in second and "did you mean trainer.total_epochs?" in second


def test_unparsable_override_says_what_overrides_look_like():
    with pytest.raises(ConfigError, match=r"cannot parse override 'lora_rank'.*key=value"):
        load_config(["lora_rank"])


def test_bad_override_value_names_key():
    with pytest.raises(ConfigError) as info:
        load_config(["actor_rollout_ref.rollout.name=vlm", "actor_rollout_ref.rollout.n=0"])
    assert [p.split("=")[0] for p in info.value.problems] == [
        "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.rollout.n",
    ]


def test_unresolvable_interpolation_names_key():
    with pytest.raises(ConfigError) as info:
        load_config(["trainer.project_name=${trainer.nope}"])
    (message,) = info.value.problems
    assert (
        message
        == "trainer.default_local_dir: cannot resolve interpolation: Interpolation key 'trainer.nope' not found"
    )


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_config_file_extends_main_config_and_overrides_win(tmp_path):
    path = _write(
        tmp_path / "exp" / "grpo_long.yaml",
        f"defaults:\n  - {CONFIG_NAME}\n  - _self_\n"
        "actor_rollout_ref:\n  rollout:\n    n: 8\ndata:\n  max_response_length: 128\n",
    )
    cfg = load_config(["data.max_response_length=100"], config_path=path)
    assert cfg.actor_rollout_ref.rollout.n == 8  # from the file
    assert cfg.data.max_response_length == 100  # the override beats the file
    assert cfg.data.max_prompt_length == 256  # from the main YAML


def test_unknown_key_in_config_file_is_named(tmp_path):
    path = _write(
        tmp_path / "bad.yaml", f"defaults:\n  - {CONFIG_NAME}\n  - _self_\nalgorithm:\n  gama: 0.9\n"
    )
    with pytest.raises(ConfigError, match=r"unknown key algorithm\.gama.*did you mean algorithm\.gamma\?"):
        load_config(config_path=path)


def test_config_file_next_to_folders_still_gets_key_suggestions(tmp_path):
    (tmp_path / "data").mkdir()  # a folder named like a section must not hide typos in that section
    path = _write(tmp_path / "exp.yaml", f"defaults:\n  - {CONFIG_NAME}\n  - _self_\n")
    with pytest.raises(ConfigError, match=r"did you mean data\.train_files\?"):
        load_config(["data.trian_files=x"], config_path=path)


def test_main_config_in_a_folder_with_spaces_and_commas(tmp_path, monkeypatch):
    main = _write(tmp_path / "main cfg, v2" / f"{CONFIG_NAME}.yaml", MAIN_YAML.read_text())
    monkeypatch.setenv("AGENTRL_CONFIG_DIR", str(main.parent))
    path = _write(
        tmp_path / "exp" / "exp.yaml", f"defaults:\n  - {CONFIG_NAME}\n  - _self_\nsft:\n  lr: 0.5\n"
    )
    assert load_config(config_path=path).sft.lr == 0.5


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(config_path="/nonexistent/cfg.yaml")


def test_saved_config_loads_back_equal(tmp_path):
    cfg = load_config(
        ["trainer.experiment_name=run1", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"]
    )
    path = save_resolved_config(cfg, tmp_path / "run" / "config.yaml")
    assert yaml.safe_load(path.read_text())["trainer"]["default_local_dir"] == "outputs/agentrl/run1"
    assert load_config(config_path=path) == cfg


def test_config_to_dict_nested_and_flat():
    cfg = AgentRLConfig()
    assert config_to_dict(cfg)["actor_rollout_ref"]["actor"]["optim"]["betas"] == [0.9, 0.999]
    flat = config_to_dict(cfg, flat=True)
    assert flat["actor_rollout_ref.actor.optim.lr"] == 1e-6
    assert flat["trainer.logger"] == ["console", "mlflow"]
    assert set(flat) == {k for k in schema_keys() if not isinstance(_dig(config_to_dict(cfg), k), dict)}


def _dig(node: dict, dotted: str):
    for part in dotted.split("."):
        node = node[part]
    return node


def test_works_inside_an_initialised_hydra_app(tmp_path):
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        assert load_config(["trainer.seed=5"]).trainer.seed == 5
        assert GlobalHydra.instance().is_initialized()


def test_config_dir_from_environment(tmp_path, monkeypatch):
    text = MAIN_YAML.read_text().replace("  total_epochs: 1 ", "  total_epochs: 3 ")
    _write(tmp_path / f"{CONFIG_NAME}.yaml", text)
    monkeypatch.setenv("AGENTRL_CONFIG_DIR", str(tmp_path))
    assert config_dir() == tmp_path
    assert load_config().trainer.total_epochs == 3


def _shipped_configs() -> list[Path]:
    return sorted(REPO.glob("configs/*.yaml")) + sorted(REPO.glob("cookbooks/**/*.yaml"))


@pytest.mark.parametrize("path", _shipped_configs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_loads(path):
    assert isinstance(load_config(config_path=path), AgentRLConfig)
