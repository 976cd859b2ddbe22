"""Train the tool agent: a two-stage warm start on the tool-call format, then GRPO with step-wise advantages.

    python cookbooks/tool_agent/train.py                                  # the config in config/tool_agent.yaml
    python cookbooks/tool_agent/train.py trainer.total_training_steps=5   # Hydra overrides, as `agentrl train`
    python cookbooks/tool_agent/train.py --short-prompt-steps 0           # one warm-start stage (with tools)

1. Warm start, from per-turn rows built from data.train_files (the tool call, then the answer after the
   `tool` message). The last `sft.val_rows` rows are held out and checked every `sft.val_freq` steps (the
   share that greedy decoding gets exactly right):
   a. on the rows without the tool schemas (~40-token prompts, so the policy learns what to call and answer
      cheaply) until the first check where `sft.stop_accuracy` of them are right, or `--short-prompt-steps`;
      saved as `<run>/warm_start/short_prompts/sft_model`. This stage sets how much of the task the policy
      knows when GRPO starts, so every seed starts from the same level rather than the same step count.
   b. `sft.max_steps` steps on the rows rendered with the tool schemas, as the gateway renders them at RL
      time, with no early stop: the format must hold under sampling; saved as `<run>/warm_start/sft_model`.
2. GRPO from that model: ToolAgentFlow calls the tools through OpenAI `tools` / `tool_calls`, each model call
   is a step with its episode's advantage (`agent.stepwise_advantage`).
3. Prints held-out accuracy of the warm-started policy and of the trained one: `held-out accuracy A -> B`.
A rerun with the same arguments reuses the warm start and resumes GRPO from its last checkpoint.
"""

import argparse
import sys
from pathlib import Path

from agentrl_tool_agent.prepare_data import SAMPLES, sft_rows, write_jsonl

from agentrl import AgentTrainer
from agentrl.cli.sft import main as sft_main
from agentrl.cli.train import import_object
from agentrl.config import ConfigError, load_config
from agentrl.data import load_dataset_rows

CONFIG = Path(__file__).resolve().parent / "config" / "tool_agent.yaml"
DEFAULT_DATA = {"data.train_files": SAMPLES / "train.jsonl", "data.val_files": SAMPLES / "test.jsonl"}
SHORT_PROMPT_STEPS = 1000
"""Stage 1a's cap: the held-out check (sft.stop_accuracy) ended it after 220-255 steps on seeds 1-3 (README)."""


def warm_start(train_files: str, overrides: list[str], warm: Path, short_prompt_steps: int) -> int:
    """Run the warm-start stages that `warm` does not hold yet; the model ends in `warm/sft_model`."""
    task_rows = load_dataset_rows(train_files)

    def sft_stage(rows: list[dict], folder: Path, *extra: str) -> int:
        write_jsonl(rows, folder / "sft.jsonl")
        return sft_main(
            ["--config", str(CONFIG), *overrides, *extra]
            + [f"data.train_files={folder / 'sft.jsonl'}", f"trainer.default_local_dir={folder}"]
        )

    model = []
    if short_prompt_steps:
        short = warm / "short_prompts"
        if not (short / "sft_model" / "config.json").is_file():
            status = sft_stage(
                sft_rows(task_rows, with_tools=False), short, f"sft.max_steps={short_prompt_steps}"
            )
            if status:
                return status
        model = [f"actor_rollout_ref.model.path={short / 'sft_model'}"]
    return sft_stage(sft_rows(task_rows), warm, *model, "sft.stop_accuracy=null")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--short-prompt-steps",
        type=int,
        default=SHORT_PROMPT_STEPS,
        help=f"most warm-start steps on rows without the tool schemas, before those with them (default "
        f"{SHORT_PROMPT_STEPS}; sft.stop_accuracy ends it sooner; 0 skips this stage, and then no stage "
        f"stops early)",
    )
    args, argv = parser.parse_known_args(argv)
    if args.short_prompt_steps < 0:
        parser.error(f"--short-prompt-steps must be 0 or more, got {args.short_prompt_steps}")
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
    # 2. Warm start (skipped when sft.enable=false or when a rerun finds it done).
    if config.sft.enable:
        warm = Path(config.trainer.default_local_dir) / "warm_start"
        if not (warm / "sft_model" / "config.json").is_file():
            status = warm_start(config.data.train_files, overrides, warm, args.short_prompt_steps)
            if status:
                return status
        model = [f"actor_rollout_ref.model.path={warm / 'sft_model'}", "sft.enable=false"]
        config = load_config([*overrides, *model], config_path=CONFIG)
    # 3. GRPO: data.train_files tasks, ToolAgentFlow, ToolAnswerEvaluator; metrics and checkpoints in run_dir.
    result = AgentTrainer(flow=flow, evaluator=evaluator, config=config).train()
    # 4. Report: validation accuracy before the first GRPO step (after the warm start) and after the last one.
    print("\n".join(result.summary_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
