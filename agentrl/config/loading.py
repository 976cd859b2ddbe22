"""Compose the YAML with Hydra overrides, resolve interpolations, validate into `AgentRLConfig`.

Where the YAML lives: the canonical file is `configs/agent_ppo_trainer.yaml` at the repository root,
next to the `agentrl/` package. `config_dir()` looks, in order, at `$AGENTRL_CONFIG_DIR`, at
`agentrl/configs/` (where a built wheel would ship a copy as package data) and at `<repo>/configs/`
(a source checkout or an editable install). The first folder holding `agent_ppo_trainer.yaml` wins.

Other configs (a cookbook's, a saved run's) are loaded with `load_config(config_path=...)`. Such a
file is usually a set of changes on top of the main config, through Hydra's defaults list::

    defaults:
      - agent_ppo_trainer
      - _self_
    actor_rollout_ref:
      rollout:
        n: 8

The main config folder is on Hydra's search path, so `agent_ppo_trainer` resolves from anywhere.
A file without a defaults list is taken as a complete config (what `save_resolved_config` writes).
Precedence: main YAML < the file at config_path < command-line overrides.

rLLM's key names `rllm.stepwise_advantage.*`, `rllm.rejection_sample.*` and `rllm.compact_filtering.*`
are accepted, in overrides and in files, as the `agent.*` keys of the same name (see `aliases.py`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from agentrl.config._base import register_resolvers
from agentrl.config.aliases import fold_alias_section, given_agent_keys, translate_override_aliases
from agentrl.config.errors import ConfigError
from agentrl.config.problems import describe_unknown_key, format_validation_errors, schema_keys
from agentrl.config.schema import AgentRLConfig

CONFIG_NAME = "agent_ppo_trainer"
"""Name (without .yaml) of the main config."""

_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_OVERRIDE_HELP = "overrides look like key=value, e.g. actor_rollout_ref.model.lora_rank=8"


def config_dir() -> Path:
    """The folder holding agent_ppo_trainer.yaml (see the module docstring for the search order)."""
    candidates = [_PACKAGE_DIR / "configs", _PACKAGE_DIR.parent / "configs"]
    if os.environ.get("AGENTRL_CONFIG_DIR"):
        candidates.insert(0, Path(os.environ["AGENTRL_CONFIG_DIR"]).expanduser().resolve())
    for folder in candidates:
        if (folder / f"{CONFIG_NAME}.yaml").is_file():
            return folder
    looked = ", ".join(str(c) for c in candidates)
    raise ConfigError(
        f"cannot find {CONFIG_NAME}.yaml (looked in {looked}); set AGENTRL_CONFIG_DIR to its folder"
    )


def load_config(overrides: Sequence[str] = (), config_path: str | os.PathLike | None = None) -> AgentRLConfig:
    """Compose the main YAML (or the file at `config_path`) with Hydra `overrides`, then validate.

    Raises ConfigError listing every problem: unparsable or unknown override keys (with the closest
    valid key), bad values (key, value, what is allowed), and cross-field rule violations.
    """
    if isinstance(overrides, str):
        raise TypeError(f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
    register_resolvers()
    overrides = translate_override_aliases(overrides)
    main_dir = config_dir()
    if config_path is None:
        search_dir, name = main_dir, CONFIG_NAME
    else:
        path = Path(config_path).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        search_dir, name = path.parent, path.stem
        if search_dir != main_dir and not any(o.split("=", 1)[0] == "hydra.searchpath" for o in overrides):
            overrides.append(f"hydra.searchpath=['file://{main_dir}']")
    _check_override_keys(overrides, [main_dir, search_dir])
    composed = _compose(search_dir, name, overrides)
    data = _to_container(composed)
    if "rllm" in data:  # a file's rLLM-style section: fold it with what the file and the command line set
        written = (
            yaml.safe_load(Path(config_path).expanduser().read_text()) if config_path is not None else None
        )
        overridden = {o.lstrip("+").split("=", 1)[0] for o in overrides if o.lstrip("+").startswith("agent.")}
        data = fold_alias_section(
            data, given=given_agent_keys(written if isinstance(written, dict) else {}), overridden=overridden
        )
    return validate_config(data)


def import_from_spec(spec: str, key: str) -> Any:
    """The object `package.module:Name` names (`agent.flow`, `agent.evaluator`), as written: not instantiated.

    The current directory is importable, as it is for `python -m`, so `agent.flow=mymodule:Solver`
    finds ./mymodule.py even from the `agentrl` console script. Any failure (not found, an error while
    the module runs, no such name) is a ConfigError naming `key` and the cause.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError([f"{key}={spec!r}: expected 'package.module:Name'"])
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raised while it ran
        raise ConfigError(
            [f"{key}={spec!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"]
        ) from exc
    if not hasattr(module, attr):
        raise ConfigError([f"{key}={spec!r}: module {module_name!r} ({module.__file__}) has no {attr!r}"])
    return getattr(module, attr)


def validate_config(data: Mapping[str, Any]) -> AgentRLConfig:
    """Validate a plain nested dict; pydantic's errors become one ConfigError that names each key.

    An `rllm:` section is read as the `agent.*` keys it aliases (an error where both set a key differently).
    """
    if "rllm" in data:
        data = fold_alias_section(data, given=given_agent_keys(data))
    try:
        return AgentRLConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_errors(exc)) from None


def _check_override_keys(overrides: list[str], search_dirs: list[Path]) -> None:
    """Refuse unknown keys ourselves, before Hydra's generic `Could not override` message."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    problems: list[str] = []
    known = set(schema_keys())
    for line in overrides:
        try:
            (override,) = parser.parse_overrides([line])
        except OverrideParseException as exc:
            problems.append(
                f"cannot parse override {line!r}: {str(exc).splitlines()[-2].strip()}; {_OVERRIDE_HELP}"
            )
            continue
        key = override.key_or_group
        if key in known or key.split(".")[0] == "hydra":
            continue
        if _is_group_override(key, search_dirs):
            continue
        problems.append(f"{describe_unknown_key(key)} (from override {line!r})")
    if problems:
        raise ConfigError(problems)


def _is_group_override(key: str, search_dirs: list[Path]) -> bool:
    """`group=option`, `group/sub=option` or `group@pkg=option`: Hydra checks those against its folders."""
    if "/" in key or "@" in key:
        return True
    return "." not in key and any((d / key).is_dir() for d in search_dirs)


@contextmanager
def _isolated_hydra() -> Iterator[None]:
    """Let load_config run inside a user's @hydra.main app: park its global state, restore it after."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    if not GlobalHydra.instance().is_initialized():
        yield
        return
    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        yield
    finally:
        restore_gh_from_backup(backup)


def _compose(search_dir: Path, name: str, overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with _isolated_hydra(), initialize_config_dir(config_dir=str(search_dir), version_base=None):
            return compose(config_name=name, overrides=overrides)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as exc:
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        raise ConfigError(
            f"cannot compose {search_dir / name}.yaml: {exc}{cause}".replace("\n", " ")
        ) from None


def _to_container(composed: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(composed, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        reason = str(getattr(exc, "msg", exc)).splitlines()[0]
        raise ConfigError(f"{key}: cannot resolve interpolation: {reason}") from None


def config_to_dict(cfg: AgentRLConfig, flat: bool = False) -> dict[str, Any]:
    """Plain JSON-able dict of the config; `flat=True` gives dotted keys (for MLflow params)."""
    nested = cfg.model_dump(mode="json")
    if not flat:
        return nested
    out: dict[str, Any] = {}

    def _walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                _walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = node

    _walk("", nested)
    return out


def config_to_yaml(cfg: AgentRLConfig) -> str:
    """The resolved config as YAML, in schema order (what `agentrl config` prints)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_resolved_config(cfg: AgentRLConfig, path: str | os.PathLike) -> Path:
    """Write the resolved config as YAML; `load_config(config_path=path)` reads it back unchanged."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(config_to_yaml(cfg))
    tmp.replace(target)
    return target
