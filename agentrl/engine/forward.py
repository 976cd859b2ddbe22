"""Forward passes over a TrainBatch: per-token log-probs and entropy (policy), per-token values (critic).

Position t of every output refers to token t: log p(token t | tokens < t) comes from the logits at t - 1,
and the value of token t is the critic's estimate of the state before it (its output at t - 1). Position 0
has no prediction and holds 0; it is never a response token.
"""

from __future__ import annotations

import torch

from agentrl.algorithms.losses import compute_entropy_from_logits, compute_token_log_probs
from agentrl.engine.assembly import TrainBatch
from agentrl.engine.fsdp import compute_device


def _shift_right(values: torch.Tensor) -> torch.Tensor:
    """(B, L-1) predictions for tokens 1.. into (B, L) aligned with token positions."""
    return torch.nn.functional.pad(values, (1, 0), value=0.0)


def compute_log_probs(
    model: torch.nn.Module, batch: TrainBatch, *, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, L) log-probs of each token under `model`, and (B, L) entropies when asked."""
    device = compute_device(model)
    input_ids = batch.input_ids.to(device)
    attention = batch.attention_mask.to(device)
    images = _image_inputs(model, batch, input_ids)
    logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False, **images).logits[:, :-1]
    logits = logits.float()
    log_probs = _shift_right(compute_token_log_probs(logits, input_ids[:, 1:]))
    entropy = _shift_right(compute_entropy_from_logits(logits)) if with_entropy else None
    return log_probs, entropy


def _image_inputs(
    model: torch.nn.Module, batch: TrainBatch, input_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Pixels of the batch's image rows (in row order) and which tokens are image pads; the model computes
    its multimodal rotary positions from them (`get_rope_index`), as the engine's prefill did."""
    rows = [x for x in batch.multi_modal_inputs or [] if x is not None]
    if not rows:
        return {}
    device = input_ids.device
    return {
        "pixel_values": torch.cat([x["pixel_values"] for x in rows]).to(device),
        "image_grid_thw": torch.cat([x["image_grid_thw"] for x in rows]).to(device),
        "mm_token_type_ids": (input_ids == model.config.image_token_id).int(),
    }


def compute_values(critic: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """(B, L) value of the state before each token, from a token-classification head with one label."""
    device = compute_device(critic)
    out = critic(
        input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device), use_cache=False
    ).logits
    return _shift_right(out[:, :-1, 0].float())
