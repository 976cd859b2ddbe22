"""The optimisation loop the actor and the critic share: PPO epochs over mini-batches of micro-batches.

One optimizer step per mini-batch, gradient clipping, a skipped step on a non-finite gradient norm, one
LR-schedule step per call. Each worker supplies only its loss.

The loss is normalised over the global mini-batch, as verl does: each micro-batch's loss (a mean over its own
tokens, or rows for the seq-mean modes) is weighted by its share of the mini-batch's tokens (or rows) on all
ranks. A token in a short micro-batch then weighs exactly what a token in a long one weighs, and 1 rank and N
ranks compute the same loss on the same batch. FSDP averages gradients over ranks, so each rank's share is
multiplied by the world size. Logged stats are weighted the same way and summed over ranks: `actor/pg_loss`
is the loss of the whole mini-batch, whatever the split. Stats whose name ends in `_max` are maxima instead:
the largest over micro-batches, steps and ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from agentrl.algorithms.rollout_correction import behaviour_weights
from agentrl.training.parallel.distributed import (
    all_reduce_max_dict,
    all_reduce_max_int,
    all_reduce_sum,
    all_reduce_sum_dict,
    world_size,
)
from agentrl.training.update.assembly import TrainBatch
from agentrl.training.update.packing import split_micro_batches, split_mini_batches

log = logging.getLogger(__name__)

MicroLoss = Callable[[TrainBatch], tuple[torch.Tensor, dict[str, float]]]

BEHAVIOUR_WEIGHTS = "behaviour_weights"
"""Key of the (B, L) off-policy correction weights in `TrainBatch.tensors` (`attach_behaviour_weights`)."""


def loss_units(response_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """What the loss averages over: response tokens (token-mean) or rows with a response token (seq-mean-*)."""
    if loss_agg_mode == "token-mean":
        return float(response_mask.sum())
    return float(response_mask.any(dim=-1).sum())


def attach_behaviour_weights(batch: TrainBatch, tis_mode: str | None, tis_cap: float) -> dict[str, float]:
    """Off-policy correction (`algorithm.rollout_correction`), once per step on the whole batch, before the update.

    Needs `batch["old_log_probs"]` (the trainer's log-probs before the update). With `tis_mode` set, stores
    the truncated importance weights min(pi_old / pi_rollout, tis_cap) as `batch["behaviour_weights"]` (B, L)
    (`agentrl.algorithms.rollout_correction.behaviour_weights`): they are fixed through the update, micro-batches
    cut them like every tensor, and the actor's loss passes them to `compute_policy_loss(behaviour_weights=...)`.
    With `tis_mode` None nothing is stored. Returns the `rollout_corr/*` metrics of the whole batch either way
    (the engine-vs-trainer mismatch; the weight statistics when `tis_mode` is set).
    """
    if "old_log_probs" not in batch.tensors:
        raise ValueError(
            "attach_behaviour_weights needs batch['old_log_probs']: compute the old log-probs first "
            "(algorithm.rollout_correction.tis_mode needs them even for an on-policy update)"
        )
    weights, metrics = behaviour_weights(
        batch["old_log_probs"], batch.rollout_log_probs, batch.response_mask, tis_mode, tis_cap
    )
    if weights is not None:
        batch[BEHAVIOUR_WEIGHTS] = weights
    return {key: float(value) for key, value in metrics.items()}


def _zero_weight_micro(batch: TrainBatch, rows: torch.Tensor) -> TrainBatch:
    """A one-row micro-batch that trains nothing: keeps ranks in step when one has fewer micro-batches."""
    micro = batch.select(rows[:1])
    micro.response_mask = torch.zeros_like(micro.response_mask)
    return micro


class MiniBatchStep:
    """The gradients of one optimizer step, accumulated micro-batch by micro-batch, and the stats they logged.

    With the mini-batch's loss units on all ranks known up front (`total_units`), each micro-batch's loss is
    weighted by its share of them. A streamed update (`async_training.streaming_update`) gets its rows as their
    groups finish, so the total is known only at the end: each loss is then weighted by its own units and `finish`
    divides the summed gradients (and stats) by the total, which is the same gradient."""

    def __init__(self, micro_loss: MicroLoss, loss_agg_mode: str, total_units: float | None = None) -> None:
        self.micro_loss = micro_loss
        self.mode = loss_agg_mode
        self.total_units = total_units
        self.units = 0.0
        self.stats_sum: dict[str, float] = {}
        self.stats_max: dict[str, float] = {}

    def add(self, micros: list[TrainBatch]) -> None:
        ranks = world_size()
        for micro in micros:
            units = loss_units(micro.response_mask, self.mode)
            weight = units / max(self.total_units, 1.0) if self.total_units is not None else units
            loss, stats = self.micro_loss(micro)
            (loss * weight * ranks).backward()
            self.units += units
            for key, value in stats.items():
                if key.endswith("_max"):
                    self.stats_max[key] = max(self.stats_max.get(key, value), value)
                else:
                    self.stats_sum[key] = self.stats_sum.get(key, 0.0) + value * weight

    def finish(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float, prefix: str, on_step
    ) -> torch.Tensor:
        """Clip and take the optimizer step (skipped on a non-finite norm); returns the gradient norm."""
        if self.total_units is None:
            total = max(all_reduce_sum(self.units), 1.0)
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.div_(total)
            self.stats_sum = {key: value / total for key, value in self.stats_sum.items()}
        grad_norm = _clip_grad_norm(model, grad_clip)
        if torch.isfinite(grad_norm):
            if on_step is not None:
                on_step()
            optimizer.step()
        else:
            log.warning("%s: non-finite grad norm %s; optimizer step skipped", prefix, grad_norm.item())
        return grad_norm


def split_micros(
    batch: TrainBatch, rows: torch.Tensor, section: Any, remove_padding: bool
) -> list[TrainBatch]:
    """`rows` of `batch` in micro-batches, as many on every rank (zero-weight ones pad the ranks with fewer)."""
    micros = split_micro_batches(
        batch,
        rows,
        micro_batch_size=section.ppo_micro_batch_size_per_gpu,
        use_dynamic_bsz=section.use_dynamic_bsz,
        max_token_len=section.ppo_max_token_len_per_gpu,
        remove_padding=remove_padding,
    )
    count = all_reduce_max_int(len(micros))
    return micros + [_zero_weight_micro(batch, rows) for _ in range(count - len(micros))]


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
    on_optimizer_step: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """Update `model` on this rank's share of the batch; `section` is the actor or critic config.

    Returns the stats of `micro_loss` weighted over the global mini-batch and averaged over optimizer steps,
    `{prefix}/grad_norm` averaged over optimizer steps, `{prefix}/lr`, and `{prefix}/skipped_steps` when a
    non-finite gradient skipped a step. Every rank returns the same numbers.
    """
    model.train()
    steps: list[tuple[MiniBatchStep, torch.Tensor]] = []
    num_minis = max(1, train_batch_size // section.ppo_mini_batch_size)
    mode = getattr(section, "loss_agg_mode", "token-mean")
    for _ in range(section.ppo_epochs):
        for rows in split_mini_batches(len(batch), num_minis, generator, shuffle):
            optimizer.zero_grad(set_to_none=True)
            micros = split_micros(batch, rows, section, remove_padding)
            total_units = all_reduce_sum(sum(loss_units(m.response_mask, mode) for m in micros))
            step = MiniBatchStep(micro_loss, mode, total_units)
            step.add(micros)
            steps.append((step, step.finish(model, optimizer, section.grad_clip, prefix, on_optimizer_step)))
    return finish_update(steps, optimizer=optimizer, scheduler=scheduler, prefix=prefix)


def finish_update(
    steps: list[tuple[MiniBatchStep, torch.Tensor]],
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    prefix: str,
) -> dict[str, float]:
    """After the optimizer steps of one update: free the gradients, step the LR schedule, reduce the metrics."""
    # Gradients are not needed until the next update: free them for the rollout.
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    stats_sum: dict[str, float] = {}
    stats_max: dict[str, float] = {}
    for step, _ in steps:
        for key, value in step.stats_sum.items():
            stats_sum[key] = stats_sum.get(key, 0.0) + value
        for key, value in step.stats_max.items():
            stats_max[key] = max(stats_max.get(key, value), value)
    norms = [float(norm) for _, norm in steps if torch.isfinite(norm)]
    skipped = len(steps) - len(norms)
    metrics = {key: value / max(len(steps), 1) for key, value in all_reduce_sum_dict(stats_sum).items()}
    metrics.update(all_reduce_max_dict(stats_max))
    metrics[f"{prefix}/grad_norm"] = sum(norms) / max(len(norms), 1)
    metrics[f"{prefix}/lr"] = scheduler.get_last_lr()[0]
    if skipped:
        metrics[f"{prefix}/skipped_steps"] = float(skipped)  # a count of optimizer steps, not averaged
    return metrics


def _clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the global norm; with FSDP2 the norm is a DTensor over every shard, made a plain tensor."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach().float().cpu()
