"""Metrics under the names verl and rLLM users look for, from episodes and from an assembled batch."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from agentrl.algorithms.filters import compute_solve_counts, count_termination_reasons
from agentrl.evaluator import EVAL_METRIC_PREFIX
from agentrl.training.update.assembly import TrainBatch, dense_ids
from agentrl.types import Episode


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    t = torch.tensor(values, dtype=torch.float64)
    return {f"{name}/mean": t.mean().item(), f"{name}/max": t.max().item(), f"{name}/min": t.min().item()}


def group_ids_of(episodes: Sequence[Episode]) -> torch.Tensor:
    """(N,) long: episodes of the same task share an id."""
    return dense_ids(e.task_id for e in episodes)


def mean_evaluator_metrics(episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    """The mean of each metric the evaluator reported (`EvalOutput.metrics`), as `{prefix}/<name>`."""
    sums: dict[str, list[float]] = defaultdict(list)
    for episode in episodes:
        for key, value in episode.metrics.items():
            if key.startswith(EVAL_METRIC_PREFIX):
                sums[key[len(EVAL_METRIC_PREFIX) :]].append(value)
    return {f"{prefix}/{name}": sum(v) / len(v) for name, v in sums.items()}


def compute_episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Reward, correctness, termination reasons and solve fractions of one step's rollouts."""
    if not episodes:
        return {}
    metrics = _stats("critic/full-score", [e.reward for e in episodes])
    metrics["batch/accuracy"] = sum(e.is_correct for e in episodes) / len(episodes)
    for reason, count in count_termination_reasons([e.termination_reason for e in episodes]).items():
        metrics[f"batch/termination_reason/{reason}"] = count / len(episodes)
    # Fractions of the step's tasks (rLLM's convention), so steps with refill rounds stay comparable.
    solve = compute_solve_counts(torch.tensor([e.is_correct for e in episodes]), group_ids_of(episodes))
    num_tasks = sum(solve)
    metrics.update(
        {
            "batch/solve_all": solve.solve_all / num_tasks,
            "batch/solve_none": solve.solve_none / num_tasks,
            "batch/solve_partial": solve.solve_partial / num_tasks,
            "batch/num_tasks": float(num_tasks),
        }
    )
    metrics.update(_stats("episode/model_calls", [e.metrics.get("num_model_calls", 0.0) for e in episodes]))
    metrics["batch/trace_mismatch"] = sum(e.metrics.get("trace_mismatch", 0.0) for e in episodes)
    metrics["batch/evaluator_errors"] = sum(e.metrics.get("evaluator_error", 0.0) for e in episodes)
    metrics.update(mean_evaluator_metrics(episodes, "batch"))
    return metrics


def compute_validation_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """`val/test_score/<data_source>`: mean reward per data source, plus overall accuracy."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for episode in episodes:
        by_source[str(episode.task.get("data_source", "unknown"))].append(episode.reward)
    metrics = {f"val/test_score/{source}": sum(v) / len(v) for source, v in by_source.items()}
    if episodes:
        metrics["val/accuracy"] = sum(e.is_correct for e in episodes) / len(episodes)
        metrics["val/num_episodes"] = float(len(episodes))
    metrics.update(mean_evaluator_metrics(episodes, "val"))
    return metrics


def compute_batch_metrics(batch: TrainBatch) -> dict[str, float]:
    """Lengths, advantages, returns, values and the rollout-vs-trainer log-prob gap of a batch."""
    mask = batch.response_mask
    response_lengths = mask.sum(dim=1).float()
    metrics = {
        "response_length/mean": response_lengths.mean().item(),
        "response_length/max": response_lengths.max().item(),
        "prompt_length/mean": (batch.attention_mask.sum(dim=1).float() - response_lengths).mean().item(),
        "batch/rows": float(len(batch)),
    }
    for key, name in (
        ("advantages", "critic/advantages"),
        ("returns", "critic/returns"),
        ("values", "critic/values"),
    ):
        if key in batch.tensors and mask.any():
            values = batch[key][mask]
            metrics.update(
                {
                    f"{name}/mean": values.mean().item(),
                    f"{name}/max": values.max().item(),
                    f"{name}/min": values.min().item(),
                }
            )
    if "old_log_probs" in batch.tensors and mask.any():
        gap = (batch["old_log_probs"] - batch.rollout_log_probs)[mask].abs()
        metrics["rollout/logprob_diff_mean"] = gap.mean().item()
        metrics["rollout/logprob_diff_max"] = gap.max().item()
    return metrics


def compute_routing_metrics(before: Sequence[int], after: Sequence[int], healthy: int) -> dict[str, float]:
    """How one step's model calls spread over the rollout servers (the pool's per-server request counters read
    before and after it): `rollout/servers` (healthy ones), `rollout/server_requests_min` and `_max` (calls on
    the least and the most used server). A max far above the min on equal servers means skewed routing."""
    calls = [end - start for start, end in zip(before, after, strict=True)]
    return {
        "rollout/servers": float(healthy),
        "rollout/server_requests_min": float(min(calls, default=0)),
        "rollout/server_requests_max": float(max(calls, default=0)),
    }


COLLAPSED_ENTROPY_SHARE = 0.9
"""A policy whose mean token entropy reaches this share of a uniform policy's (ln of the vocabulary) has collapsed."""


def collapse_warning(metrics: dict[str, float], vocab_size: int, step: int) -> str | None:
    """The warning for a policy that samples almost uniformly, or None.

    Such a policy earns no reward, its groups are uniform and its updates are zero: the run goes on, silently, on
    noise (seen with `async_training.staleness_threshold=1` on the tool-agent cookbook, seed 3, entropy 0.3 -> 7.5
    of ln(2,048) = 7.62 by step 10). A model with random weights starts there too.
    """
    entropy = metrics.get("actor/entropy")
    if entropy is None or vocab_size < 2:
        return None
    uniform = math.log(vocab_size)
    if entropy < COLLAPSED_ENTROPY_SHARE * uniform:
        return None
    return (
        f"step {step}: actor/entropy {entropy:.2f} is {entropy / uniform:.0%} of a uniform policy's "
        f"ln({vocab_size}) = {uniform:.2f}: the policy samples almost at random, so rewards and updates carry "
        "no signal. From a trained model this is a collapse: lower actor_rollout_ref.actor.optim.lr, and with "
        "async_training.staleness_threshold > 0 try the synchronous loop (docs/troubleshooting.md)"
    )
