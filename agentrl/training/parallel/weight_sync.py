"""Push the actor's weights to the policy serving (`rollout/serving`) and verify that what is served is what was trained.

Two checks, strongest first:
- fingerprint: the embedded engine hashes its served weights (`fingerprint_state_dict`); it must equal the
  hash of what was pushed (built tensor by tensor as the weights stream in), bit for bit.
- probe: vLLM cannot report a hash of its weights (nor a policy version), so every server answers one short
  greedy completion of a fixed prompt with log-probs, and the trainer scores the same tokens itself. The
  largest gap must be within a tolerance set by the coarser of the two dtypes (`probe_tolerance`). This
  catches a reload that did not happen or landed wrong (old or partial weights, a stale tied lm_head)
  wherever it moves the log-probs by more than the tolerance; drift below it is what the per-batch metric
  `rollout/logprob_diff_max` keeps watching.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from agentrl.rollout.engines._weights import Fingerprint
from agentrl.rollout.serving import PolicyServing, ProbeResult
from agentrl.training.parallel.fsdp import compute_device
from agentrl.training.parallel.served_weights import iter_served_weights

PROBE_TEXT = "Weight sync check: 1 2 3 4"
PROBE_MAX_TOKENS = 4
# Log-prob gaps between two engines that run the same weights (greedy tokens of a short probe):
# float32 on both sides differs only in summation order (vLLM CPU vs transformers on tiny:qwen2: ~5e-7);
# bf16/fp16 round activations at every layer, so the bound there is loose (an assumption, not a measurement).
_TOLERANCES = {"float32": 1e-3, "low_precision": 0.25}


def probe_tolerance(*dtypes: str) -> float:
    """Largest allowed probe log-prob gap when the engines compute in `dtypes` ('auto' counts as low)."""
    if all(d == "float32" for d in dtypes):
        return _TOLERANCES["float32"]
    return _TOLERANCES["low_precision"]


def max_logprob_gap(served: Sequence[float], trained: Sequence[float]) -> float:
    """max |served - trained| over the probe's tokens; inf when the lengths differ or there are none."""
    if len(served) != len(trained) or not served:
        return float("inf")
    return max(abs(a - b) for a, b in zip(served, trained, strict=True))


@torch.no_grad()
def score_tokens(model: torch.nn.Module, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> list[float]:
    """The model's log-prob of each of `token_ids` following `prompt_ids` (one forward, eval mode)."""
    device = compute_device(model)
    ids = torch.tensor([list(prompt_ids) + list(token_ids)], device=device)
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1].float()
    finally:
        model.train(was_training)
    targets = torch.tensor(list(token_ids), device=device)[:, None]
    return logits.log_softmax(-1).gather(-1, targets).squeeze(-1).tolist()


def check_probe(
    model: torch.nn.Module, prompt_ids: Sequence[int], results: Sequence[ProbeResult], tolerance: float
) -> float:
    """Score every server's probe tokens with `model`; raise naming the first server off by more than
    `tolerance`. Returns the largest gap seen."""
    worst = 0.0
    for result in results:
        gap = max_logprob_gap(result.logprobs, score_tokens(model, prompt_ids, result.token_ids))
        if gap > tolerance:
            raise RuntimeError(
                f"weight sync failed: server {result.url} log-probs differ from the trainer's by {gap:.3g} "
                f"(tolerance {tolerance:g}) on the probe's tokens {result.token_ids}; refusing to generate "
                f"with weights the trainer does not hold"
            )
        worst = max(worst, gap)
    return worst


def sync_rollout_weights(
    actor: torch.nn.Module,
    rollout: PolicyServing,
    tokenizer: Any,
    *,
    dtypes: Sequence[str],
    served_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Stream `actor`'s served weights (LoRA merged, FSDP shards gathered, cast to `served_dtype`) into the
    engine and verify them; returns the sync metrics."""
    pushed = Fingerprint()

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_served_weights(actor, served_dtype):
            pushed.add(name, tensor)
            yield name, tensor

    version = rollout.push_weights(stream())
    metrics = {"rollout/policy_version": float(version)}
    served = rollout.served_fingerprint()
    if served is not None:
        expected = pushed.hexdigest()
        if served != expected:
            raise RuntimeError(
                f"weight sync failed: the engine serves fingerprint {served}, the trainer "
                f"holds {expected}; refusing to generate with stale weights"
            )
        return metrics
    prompt_ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    results = rollout.probe(prompt_ids, PROBE_MAX_TOKENS)
    metrics["rollout/sync_probe_logprob_diff"] = check_probe(
        actor, prompt_ids, results, probe_tolerance(*dtypes)
    )
    return metrics
