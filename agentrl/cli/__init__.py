"""The `agentrl` command: a table of subcommands, each imported only when it runs.

Lazy imports keep `agentrl config` (and `--help`) fast: it validates the configuration and imports
`agent.flow` / `agent.evaluator` without loading torch, transformers or Ray. A subcommand is a function `fn(argv: list[str]) -> int | None`
named as "module:function" in `COMMANDS`; None means exit status 0. A `ConfigError` from any
subcommand is printed as its list of problems with exit status 2.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from agentrl.config.errors import ConfigError


class Command(NamedTuple):
    target: str
    """"module:function" to import and call with the remaining arguments."""
    summary: str
    """One line for `agentrl --help`."""


COMMANDS: dict[str, Command] = {
    "config": Command("agentrl.cli.config:main", "print the resolved, validated configuration as YAML"),
    "train": Command("agentrl.cli.train:main", "train a policy with the agent PPO trainer (Hydra overrides)"),
    "sft": Command("agentrl.cli.sft:main", "supervised fine-tuning warm start (Hydra overrides)"),
    "serve": Command("agentrl.cli.serve:main", "serve a policy behind an OpenAI-compatible endpoint"),
    "rollouts": Command("agentrl.cli.rollouts:main", "print a run's saved episodes (RUN_DIR [--step N])"),
}
"""Subcommand name -> where its entry point lives."""


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [
        "usage: agentrl <command> [args...]",
        "",
        "Agent-centric reinforcement learning for language models.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()),
        "",
        "Run `agentrl <command> --help` for a command's arguments.",
    ]
    return "\n".join(lines)


def _resolve(name: str) -> Callable[[list[str]], int | None] | None:
    """Import a subcommand's function; print why not (instead of a traceback) when it cannot be."""
    module_name, func_name = COMMANDS[name].target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            print(
                f"agentrl {name}: not available in this installation (module {module_name} not found)",
                file=sys.stderr,
            )
        else:
            print(f"agentrl {name}: cannot import {module_name}: {exc}", file=sys.stderr)
        return None
    func = getattr(module, func_name, None)
    if func is None:
        print(f"agentrl {name}: {module_name} has no function {func_name}", file=sys.stderr)
    return func


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `agentrl` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"agentrl: unknown command {name!r}{hint} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    func = _resolve(name)
    if func is None:
        return 1
    try:
        status = func(rest)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(status or 0)
