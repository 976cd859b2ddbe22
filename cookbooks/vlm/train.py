"""Train a vision-language policy to count shapes with GRPO: a recipe to copy and edit, not to subclass.

    python cookbooks/vlm/train.py                                           # config/vlm.yaml
    python cookbooks/vlm/train.py agent.flow=agentrl_vlm.flow:ZoomFlow      # look, zoom, answer
    python cookbooks/vlm/train.py actor_rollout_ref.model.lora_rank=16      # VLM + LoRA

1. Draws the pictures (agentrl_vlm.prepare_data) under the run folder, unless data.train_files is given.
2. Trains: a warm start on the answer format (random digits, sft.*), then GRPO on the count reward.
3. Prints held-out accuracy of the warm-started policy and of the trained one: `held-out accuracy A -> B`.
"""

import sys
from pathlib import Path

from agentrl_vlm.prepare_data import write_dataset

from agentrl import AgentTrainer
from agentrl.cli.train import import_object
from agentrl.config import ConfigError, load_config

CONFIG = Path(__file__).resolve().parent / "config" / "vlm.yaml"


def main(argv: list[str]) -> int:
    # 1. Config: config/vlm.yaml < command-line overrides, validated before anything loads.
    try:
        config = load_config(argv, config_path=CONFIG)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    # 2. Data: pictures drawn once per run folder (a rerun reuses them) unless data files are given.
    if not any(arg.startswith("data.train_files=") for arg in argv):
        paths = write_dataset(Path(config.trainer.default_local_dir) / "data")
        argv = [f"data.train_files={paths['train']}", f"data.val_files={paths['test']}", *argv]
    try:
        config = load_config(argv, config_path=CONFIG)
        flow = import_object(config.agent.flow, "agent.flow", prompt_key=config.data.prompt_key)
        evaluator = import_object(config.agent.evaluator, "agent.evaluator")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    # 3. Warm start + GRPO; metrics and checkpoints in the run folder.
    result = AgentTrainer(flow=flow, evaluator=evaluator, config=config).train()
    # 4. Report: validation accuracy before the first GRPO step (after the warm start) and after the last one.
    print("\n".join(result.summary_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
