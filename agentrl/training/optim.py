"""Optimizer and learning-rate schedule from an `optim` config section (actor, critic and SFT share it)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: Any) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, with `optim.lr`, `optim.weight_decay`, `optim.betas`."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: with LoRA check actor_rollout_ref.model.target_modules")
    return torch.optim.AdamW(
        trainable, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas)
    )


def warmup_steps(optim: Any, total_steps: int) -> int:
    """`lr_warmup_steps` when set (>= 0), else `lr_warmup_steps_ratio * total_steps`."""
    if optim.lr_warmup_steps is not None and optim.lr_warmup_steps >= 0:
        return int(optim.lr_warmup_steps)
    return int(optim.lr_warmup_steps_ratio * total_steps)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim: Any, total_steps: int):
    """Linear warmup, then constant or cosine decay to `min_lr_ratio * lr`; stepped once per training step."""
    warmup = warmup_steps(optim, total_steps)
    decay_steps = max(1, total_steps - warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if optim.lr_scheduler_type == "cosine":
            progress = min(1.0, (step - warmup) / decay_steps)
            return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
