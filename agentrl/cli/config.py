"""`agentrl config`: print the configuration exactly as `agentrl train` would load it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """`agentrl config [-c FILE] [overrides...]`: print the config exactly as `agentrl train` would load it."""
    parser = argparse.ArgumentParser(
        prog="agentrl config",
        description="Compose configs/agent_ppo_trainer.yaml with Hydra overrides, validate, print as YAML.",
    )
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. actor_rollout_ref.model.lora_rank=8"
    )
    parser.add_argument(
        "-c", "--config", dest="config_path", help="a config YAML to start from (e.g. a cookbook's)"
    )
    ns = parser.parse_args(list(argv))

    from agentrl.cli.train import build_agent
    from agentrl.config import config_to_yaml, load_config

    cfg = load_config(ns.overrides, config_path=ns.config_path)
    build_agent(cfg)  # a flow or evaluator that does not import fails here, not minutes into `train`
    sys.stdout.write(config_to_yaml(cfg))
    return 0
