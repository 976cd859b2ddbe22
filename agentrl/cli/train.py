"""`agentrl train`: the configured flow and evaluator, trained from the command line (and helpers `agentrl sft` shares).

    agentrl train --config configs/arithmetic.yaml          # the default run (what `make train` does)
    agentrl train trainer.total_training_steps=20 actor_rollout_ref.rollout.n=8
    agentrl sft sft.max_steps=200                             # warm start only; writes {default_local_dir}/sft_model

`--config PATH` layers a YAML (which starts with `defaults: [agent_ppo_trainer, _self_]`) over the main config;
overrides come last. The flow and evaluator come from `agent.flow` and `agent.evaluator` ("package.module:Name",
importable from the current directory); a class is instantiated with no arguments (a `prompt_key` parameter
gets `data.prompt_key`).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from typing import Any

from agentrl.config import AgentRLConfig, ConfigError, load_config
from agentrl.config.loading import import_from_spec

_EPILOG = """\
examples:
  agentrl {name} --config configs/arithmetic.yaml
  agentrl {name} trainer.total_training_steps=20 actor_rollout_ref.rollout.n=8
  agentrl config [same arguments]     # print the configuration this command would use

Every key is listed in docs/configuration.md; a rerun with the same arguments resumes from the
last checkpoint in trainer.default_local_dir (trainer.resume_mode=auto)."""


def import_object(spec: str, key: str, **kwargs: Any) -> Any:
    """`package.module:Name` -> the object; a class is instantiated with those of `kwargs` it accepts."""
    obj = import_from_spec(spec, key)
    if not isinstance(obj, type):
        return obj
    try:
        accepted = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        accepted = {}
    try:
        return obj(**{name: value for name, value in kwargs.items() if name in accepted})
    except TypeError as exc:
        raise ConfigError([f"{key}={spec!r}: cannot build {obj.__name__} with no arguments: {exc}"]) from exc


def build_agent(config: AgentRLConfig) -> tuple[Any, Any]:
    """The flow and evaluator `agent.flow` / `agent.evaluator` name, checked: ConfigError naming the key."""
    from agentrl.trainer import evaluator_problem, flow_problem

    flow = import_object(config.agent.flow, "agent.flow", prompt_key=config.data.prompt_key)
    grader = import_object(config.agent.evaluator, "agent.evaluator")
    problems = [
        f"{key}={spec!r}: {problem}"
        for key, spec, problem in (
            ("agent.flow", config.agent.flow, flow_problem(flow)),
            ("agent.evaluator", config.agent.evaluator, evaluator_problem(grader)),
        )
        if problem
    ]
    if problems:
        raise ConfigError(problems)
    return flow, grader


def build_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The arguments of `agentrl train` / `agentrl sft`: a config file and Hydra overrides."""
    parser = argparse.ArgumentParser(
        prog=f"agentrl {name}",
        description=description,
        epilog=_EPILOG.format(name=name),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="Hydra overrides of the configuration, e.g. actor_rollout_ref.model.lora_rank=8",
    )
    parser.add_argument(
        "-c",
        "--config",
        dest="config_path",
        metavar="PATH",
        help="a YAML layered over the main config (e.g. configs/arithmetic.yaml or a cookbook's)",
    )
    return parser


def load_command(name: str, description: str, argv: list[str]):
    """(config, flow, evaluator), or an exit status: 0 after --help, 2 for bad arguments or config."""
    try:
        ns = build_parser(name, description).parse_intermixed_args(argv)
    except SystemExit as exc:  # --help (0) or an argument argparse refused (2, usage printed)
        return int(exc.code or 0)
    try:
        config = load_config(ns.overrides, config_path=ns.config_path)
        flow, grader = build_agent(config)
        return config, flow, grader
    except ConfigError as exc:
        print(f"agentrl: invalid configuration:\n{exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """`agentrl train [--config PATH] [overrides...]`."""
    loaded = load_command("train", "Train a policy with the agent PPO trainer.", argv_or_sys(argv))
    if isinstance(loaded, int):
        return loaded
    from agentrl.data import DatasetError
    from agentrl.trainer import AgentTrainer

    config, flow, grader = loaded
    try:
        trainer = AgentTrainer(flow=flow, evaluator=grader, config=config)
    except (DatasetError, ConfigError, ValueError) as exc:
        print(f"agentrl: {exc}", file=sys.stderr)
        return 2
    result = trainer.train()
    for line in result.summary_lines():
        print(f"agentrl: {line}")
    return 0


def argv_or_sys(argv: list[str] | None) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)
