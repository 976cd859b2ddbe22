"""rLLM's key names as aliases: `rllm.<section>.*` means `agent.<section>.*` for the sections below.

rLLM keeps its agent-side settings under `rllm.` (`rllm.stepwise_advantage.enable=true`); agentrl
keeps them under `agent.`. Accepting both lets an rLLM override list or config file load unchanged.
The same setting given under both names with different values is an error naming both keys, so
neither silently wins. Between a config file and the command line the usual precedence applies:
a command-line `agent.*` override beats a file's `rllm.*` value, as it beats the file's `agent.*`.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import yaml

from agentrl.config.errors import ConfigError
from agentrl.config.problems import describe_unknown_key, schema_keys

ALIASED_SECTIONS = ("stepwise_advantage", "rejection_sample", "compact_filtering")
"""`rllm.<section>.*` is accepted as `agent.<section>.*` for these sections."""

_ALIASES_HELP = (
    f"agentrl accepts {', '.join(f'rllm.{s}.*' for s in ALIASED_SECTIONS)} as aliases of the agent.* keys "
    f"of the same name; other rLLM settings have their own agentrl keys (docs/configuration.md)"
)
_OVERRIDE = re.compile(r"(?P<plus>\+{0,2})rllm\.(?P<rest>[^=]+)(?P<value>=.*)?", re.DOTALL)


def _parse_value(text: str) -> Any:
    """`true`, `True` and `1.0` compare as the values Hydra would give them."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def translate_override_aliases(overrides: Sequence[str]) -> list[str]:
    """Rewrite `rllm.<section>.<key>=v` overrides as `agent.<section>.<key>=v`.

    A `+`/`++` prefix is dropped (the agent keys always exist). Raises ConfigError when an alias and
    the agent key it names are both given with different values, or when an `rllm.*` key has no alias.
    """
    out: list[str] = []
    direct: dict[str, tuple[Any, str]] = {}
    aliased: list[tuple[str, Any, str, str]] = []
    problems: list[str] = []
    for line in overrides:
        match = _OVERRIDE.fullmatch(line)
        if match is None:
            out.append(line)
            key, _, value = line.lstrip("+").partition("=")
            if key.startswith("agent."):
                direct[key] = (_parse_value(value), line)
            continue
        rest, value = match["rest"], match["value"] or ""
        if rest.split(".")[0] not in ALIASED_SECTIONS:
            problems.append(f"rllm.{rest} (from override {line!r}) has no agentrl alias; {_ALIASES_HELP}")
            continue
        if f"agent.{rest}" not in schema_keys():
            problems.append(f"{describe_unknown_key(f'agent.{rest}')} (from override {line!r})")
            continue
        aliased.append((f"agent.{rest}", _parse_value(value[1:]), line, f"agent.{rest}{value}"))
    for key, value, line, translated in aliased:
        if key in direct:
            if direct[key][0] != value:
                problems.append(
                    f"{line!r} and {direct[key][1]!r} set {key} twice with different values "
                    f"(rllm.* is an alias of agent.*); give only one of them"
                )
            continue  # the same value twice: keep the agent.* override only
        direct[key] = (value, line)
        out.append(translated)
    if problems:
        raise ConfigError(problems)
    return out


def _flatten(node: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(node, Mapping):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flatten(value, f"{prefix}.{key}"))
    return out


def fold_alias_section(
    data: Mapping[str, Any], *, given: Mapping[str, Any], overridden: Collection[str] = ()
) -> dict[str, Any]:
    """Move a top-level `rllm:` section of `data` into its `agent:` section; returns a new dict.

    given: dotted `agent.*` keys set next to the `rllm:` section (in the same file or dict) with
    their values; one that differs from its alias is a ConfigError naming both. overridden: dotted
    `agent.*` keys set on the command line; those keep their value (the command line wins).
    """
    data = {key: value for key, value in data.items()}
    section = data.pop("rllm", None)
    if section is None:
        return data
    if not isinstance(section, Mapping):
        raise ConfigError([f"rllm: expected a mapping of sections; {_ALIASES_HELP}"])
    agent = _copy_tree(data.get("agent") or {})
    problems: list[str] = []
    for dotted, value in _flatten(section, "rllm").items():
        rest = dotted[len("rllm.") :]
        if rest.split(".")[0] not in ALIASED_SECTIONS:
            problems.append(f"{dotted} has no agentrl alias; {_ALIASES_HELP}")
            continue
        key = f"agent.{rest}"
        if key in overridden:
            continue
        if key in given and given[key] != value:
            problems.append(
                f"{dotted}={value!r} and {key}={given[key]!r} set the same key to different values "
                f"(rllm.* is an alias of agent.*); give only one of them"
            )
            continue
        node = agent
        *parents, leaf = rest.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    if problems:
        raise ConfigError(problems)
    data["agent"] = agent
    return data


def given_agent_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted `agent.*` keys and values of a (nested) mapping, e.g. a config file as written."""
    agent = data.get("agent")
    return _flatten(agent, "agent") if isinstance(agent, Mapping) else {}


def _copy_tree(node: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy_tree(v) if isinstance(v, Mapping) else v for k, v in node.items()}
