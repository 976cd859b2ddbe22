"""The optimisation loop the actor and the critic share: PPO epochs over mini-batches of micro-batches.

One optimizer step per mini-batch (gradients accumulated over its micro-batches, each weighted by its share
of the rows), gradient clipping, a skipped step on a non-finite gradient norm, one LR-schedule step per call.
Each worker supplies only its loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from agentrl.engine.assembly import TrainBatch
from agentrl.engine.packing import split_micro_batches, split_mini_batches

log = logging.getLogger(__name__)

MicroLoss = Callable[[TrainBatch], tuple[torch.Tensor, dict[str, float]]]


def run_ppo_updates(
    batch: TrainBatch,
    micro_loss: MicroLoss,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    generator: torch.Generator,
    section: Any,
    train_batch_size: int,
    shuffle: bool,
    remove_padding: bool,
    prefix: str,
) -> dict[str, float]:
    """Update `model` on `batch`; `section` is the actor or critic config (ppo_* keys, grad_clip).

    Returns the mean of `micro_loss`'s stats over micro-batches, `{prefix}/grad_norm` averaged over optimizer
    steps, `{prefix}/lr`, and `{prefix}/skipped_steps` when a non-finite gradient skipped a step.
    """
    model.train()
    stats_sum: dict[str, float] = {}
    micro_count = grad_norm_sum = 0.0
    steps = skipped = 0
    num_minis = max(1, train_batch_size // section.ppo_mini_batch_size)
    for _ in range(section.ppo_epochs):
        for rows in split_mini_batches(len(batch), num_minis, generator, shuffle):
            optimizer.zero_grad(set_to_none=True)
            for micro in split_micro_batches(
                batch,
                rows,
                micro_batch_size=section.ppo_micro_batch_size_per_gpu,
                use_dynamic_bsz=section.use_dynamic_bsz,
                max_token_len=section.ppo_max_token_len_per_gpu,
                remove_padding=remove_padding,
            ):
                loss, stats = micro_loss(micro)
                (loss * len(micro) / len(rows)).backward()
                for key, value in stats.items():
                    stats_sum[key] = stats_sum.get(key, 0.0) + value
                micro_count += 1
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), section.grad_clip)
            steps += 1
            if torch.isfinite(grad_norm):
                optimizer.step()
                grad_norm_sum += float(grad_norm)
            else:
                skipped += 1
                log.warning("%s: non-finite grad norm %s; optimizer step skipped", prefix, grad_norm.item())
    scheduler.step()
    metrics = {key: value / max(micro_count, 1) for key, value in stats_sum.items()}
    metrics[f"{prefix}/grad_norm"] = grad_norm_sum / max(steps - skipped, 1)
    metrics[f"{prefix}/lr"] = scheduler.get_last_lr()[0]
    if skipped:
        metrics[f"{prefix}/skipped_steps"] = float(skipped)  # a count of optimizer steps, not averaged
    return metrics
