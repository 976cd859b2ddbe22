"""`agentrl sft`: the supervised warm start alone, saved as a Hugging Face folder under the run folder."""

from __future__ import annotations

import sys

from agentrl.cli.train import argv_or_sys, load_command
from agentrl.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    """`agentrl sft [--config PATH] [overrides...]`: the supervised warm start alone, saved as a HF folder."""
    loaded = load_command("sft", "Supervised fine-tuning warm start on data.train_files.", argv_or_sys(argv))
    if isinstance(loaded, int):
        return loaded
    from pathlib import Path

    from agentrl.data import DatasetError
    from agentrl.trainer import environment_problems, resolve_rows, setup_logging

    config = loaded[0]
    try:
        problems = environment_problems(config)
        if problems:
            raise ConfigError(problems)
        rows = resolve_rows(None, config.data.train_files, "data.train_files", config.data.prompt_key)
    except (DatasetError, ConfigError) as exc:
        print(f"agentrl: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print("agentrl: no training rows: set data.train_files", file=sys.stderr)
        return 2
    import torch

    from agentrl.training.workers.policy_worker import PolicyWorker

    setup_logging()
    device = config.trainer.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    worker = PolicyWorker(config, total_steps=1, device=device)
    metrics = worker.warm_start(config.sft, rows)
    out = Path(config.trainer.default_local_dir) / "sft_model"
    worker.export(out)
    print(f"agentrl: SFT {metrics}; saved to {out}")
    return 0
