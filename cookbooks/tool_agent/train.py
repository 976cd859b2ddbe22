"""Train the tool agent: a warm start on the tool-call format, then GRPO with step-wise advantages.

    python cookbooks/tool_agent/train.py                                  # the config in config/tool_agent.yaml
    python cookbooks/tool_agent/train.py trainer.total_training_steps=5   # Hydra overrides, as `agentrl train`

1. Warm start: per-turn rows built from data.train_files (the tool call, then the answer after the `tool`
   message), rendered with the tool schemas as the gateway renders them; saved as `<run>/warm_start/sft_model`.
2. GRPO from that model: ToolAgentFlow calls the tools through OpenAI `tools` / `tool_calls`, each model call
   is a step with its episode's advantage (`agent.stepwise_advantage`).
3. Prints held-out accuracy of the warm-started policy and of the trained one: `held-out accuracy A -> B`.
A rerun with the same arguments reuses the warm start and resumes GRPO from its last checkpoint.
"""

import sys
from pathlib import Path

from agentrl_tool_agent.prepare_data import SAMPLES, sft_rows, write_jsonl

from agentrl import AgentTrainer
from agentrl.config import ConfigError, load_config
from agentrl.data import load_dataset_rows
from agentrl.trainer_cli import import_object, sft_main

CONFIG = Path(__file__).resolve().parent / "config" / "tool_agent.yaml"
DEFAULT_DATA = {"data.train_files": SAMPLES / "train.jsonl", "data.val_files": SAMPLES / "test.jsonl"}


def main(argv: list[str]) -> int:
    # 1. Config: config/tool_agent.yaml < the shipped data (unless overridden) < command-line overrides.
    overrides = [f"{k}={v}" for k, v in DEFAULT_DATA.items() if not any(a.startswith(f"{k}=") for a in argv)]
    overrides += argv
    try:
        config = load_config(overrides, config_path=CONFIG)
        flow = import_object(config.agent.flow, "agent.flow", prompt_key=config.data.prompt_key)
        evaluator = import_object(config.agent.evaluator, "agent.evaluator")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    run_dir = Path(config.trainer.default_local_dir)
    # 2. Warm start (skipped when sft.enable=false or when a rerun finds it done).
    model_overrides = []
    if config.sft.enable:
        warm = run_dir / "warm_start"
        if not (warm / "sft_model" / "config.json").is_file():
            write_jsonl(sft_rows(load_dataset_rows(config.data.train_files)), warm / "sft.jsonl")
            status = sft_main(
                ["--config", str(CONFIG), *overrides]
                + [f"data.train_files={warm / 'sft.jsonl'}", f"trainer.default_local_dir={warm}"]
            )
            if status:
                return status
        model_overrides = [f"actor_rollout_ref.model.path={warm / 'sft_model'}", "sft.enable=false"]
        config = load_config([*overrides, *model_overrides], config_path=CONFIG)
    # 3. GRPO: data.train_files tasks, ToolAgentFlow, ToolAnswerEvaluator; metrics and checkpoints in run_dir.
    result = AgentTrainer(flow=flow, evaluator=evaluator, config=config).train()
    # 4. Report: validation accuracy before the first GRPO step (after the warm start) and after the last one.
    print("\n".join(result.summary_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
