"""`agentrl train` and `agentrl sft`: the configured flow and evaluator, trained from the command line.

    agentrl train --config configs/arithmetic.yaml          # the default run (what `make train` does)
    agentrl train trainer.total_training_steps=20 actor_rollout_ref.rollout.n=8
    agentrl sft sft.max_steps=200                             # warm start only; writes {default_local_dir}/sft_model

`--config PATH` layers a YAML (which starts with `defaults: [agent_ppo_trainer, _self_]`) over the main config;
overrides come last. The flow and evaluator come from `agent.flow` and `agent.evaluator` ("package.module:Name").
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from agentrl.config import ConfigError, load_config


def import_object(spec: str, key: str) -> Any:
    """`package.module:Name` -> the object; a class is instantiated with no arguments."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError([f"{key}={spec!r}: expected 'package.module:Name'"])
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError([f"{key}={spec!r}: cannot import it ({exc})"]) from exc
    return obj() if isinstance(obj, type) else obj


def split_config_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    """(`--config PATH` or None, the Hydra overrides)."""
    config_path, overrides = None, []
    args = iter(argv)
    for arg in args:
        if arg in ("--config", "-c"):
            config_path = next(args, None)
            if config_path is None:
                raise ConfigError(["--config needs a path to a YAML file"])
        elif arg.startswith("--config="):
            config_path = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    return config_path, overrides


def _load(argv: list[str]):
    try:
        config_path, overrides = split_config_arg(argv)
        config = load_config(overrides, config_path=config_path)
        return (
            config,
            import_object(config.agent.flow, "agent.flow"),
            import_object(config.agent.evaluator, "agent.evaluator"),
        )
    except ConfigError as exc:
        print(f"agentrl: invalid configuration:\n{exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def main(argv: list[str] | None = None) -> int:
    """`agentrl train [overrides...]`."""
    from agentrl.data import DatasetError
    from agentrl.trainer import AgentTrainer

    config, flow, grader = _load(list(sys.argv[1:] if argv is None else argv))
    try:
        trainer = AgentTrainer(flow=flow, evaluator=grader, config=config)
    except (DatasetError, ConfigError) as exc:
        print(f"agentrl: {exc}", file=sys.stderr)
        return 2
    result = trainer.train()
    before = result.initial_val_metrics.get("val/accuracy")
    after = result.metrics.get("val/accuracy")
    print(f"agentrl: trained {result.global_step} steps; run folder {result.run_dir}")
    if before is not None and after is not None:
        print(f"agentrl: held-out accuracy {before:.3f} -> {after:.3f}")
    return 0


def sft_main(argv: list[str] | None = None) -> int:
    """`agentrl sft [overrides...]`: the supervised warm start alone, saved as a Hugging Face folder."""
    from pathlib import Path

    from agentrl.engine.policy_worker import PolicyWorker
    from agentrl.trainer import resolve_rows, setup_logging

    config, _flow, _grader = _load(list(sys.argv[1:] if argv is None else argv))
    setup_logging()
    rows = resolve_rows(None, config.data.train_files, "data.train_files")
    worker = PolicyWorker(
        config, total_steps=1, device="cpu" if config.trainer.device == "auto" else config.trainer.device
    )
    metrics = worker.warm_start(config.sft, rows)
    out = Path(config.trainer.default_local_dir) / "sft_model"
    worker.export(out)
    print(f"agentrl: SFT {metrics}; saved to {out}")
    return 0
