"""Train a math solver on GSM8K-format data with GRPO: a recipe to copy and edit, not to subclass.

    python cookbooks/math/train.py                                   # the config in config/math.yaml
    python cookbooks/math/train.py trainer.total_training_steps=2    # Hydra overrides, as `agentrl train`
    python cookbooks/math/train.py agent.flow=agentrl_math.flow:SelfCheckFlow

Reads config/math.yaml (which extends agentrl's main config), trains the flow and evaluator named by
`agent.flow` / `agent.evaluator` on `data.train_files`, and prints held-out accuracy before and after.
"""

import sys
from pathlib import Path

from agentrl import AgentTrainer
from agentrl.cli.train import import_object
from agentrl.config import ConfigError, load_config

CONFIG = Path(__file__).resolve().parent / "config" / "math.yaml"


def main(overrides: list[str]) -> int:
    # 1. Config: config/math.yaml < command-line overrides, validated before anything loads.
    try:
        config = load_config(overrides, config_path=CONFIG)
        # 2. Agent and grader: agentrl_math.flow:MathSolverFlow and agentrl_math.evaluator:GSM8KEvaluator
        #    by default. To pass arguments, build them here instead, e.g. GSM8KEvaluator(format_reward=0.1).
        flow = import_object(config.agent.flow, "agent.flow")
        evaluator = import_object(config.agent.evaluator, "agent.evaluator")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    # 3. Train: data comes from data.train_files / data.val_files; checkpoints and metrics go to the run folder.
    result = AgentTrainer(flow=flow, evaluator=evaluator, config=config).train()
    # 4. Report: validation accuracy before the first step and after the last one.
    before = result.initial_val_metrics.get("val/accuracy")
    after = result.metrics.get("val/accuracy")
    print(f"trained {result.global_step} steps; run folder: {result.run_dir}")
    print(f"held-out accuracy: before {_percent(before)}, after {_percent(after)}")
    return 0


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
