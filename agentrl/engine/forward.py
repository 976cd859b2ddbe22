"""Forward passes over a TrainBatch: per-token log-probs and entropy (policy), per-token values (critic).

Position t of every output refers to token t: log p(token t | tokens < t) comes from the logits at t - 1,
and the value of token t is the critic's estimate of the state before it (its output at t - 1). Position 0
has no prediction and holds 0; it is never a response token.

Log-probs and entropy are computed inside the model's output head, on response tokens only, a chunk of
tokens at a time, each chunk under activation checkpointing: the (B, L, V) logits are never materialised, in
the compute dtype or in float32 (for a 151,936-token vocabulary, 16 rows x 400 tokens of float32 logits are
3.9 GB, and their softmax and gradient as much again). Prompt and padding positions, which no loss reads,
cost nothing and hold 0. The head's forward is swapped for the duration of the call (not its module), so
FSDP sees the usual forward and its hooks gather and free the head's weight as they always do. Models whose
forward changes the logits after the head (soft-capping, logit scales) keep the whole-logits path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from agentrl.algorithms.losses import compute_entropy_from_logits, compute_token_log_probs
from agentrl.engine.assembly import TrainBatch
from agentrl.engine.fsdp import compute_device

CHUNK_ELEMENTS = 1 << 25
"""Float32 logits per chunk (128 MiB, 220 tokens of a 151,936-token vocabulary). A chunk's backward holds
several tensors of this size (the logits, their softmax, the entropy's terms and their gradients), so this sets
the update's peak above weights, gradients and optimizer state; the GEMMs stay large enough to run at speed."""
_LOGIT_POSTPROCESSING = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier_scale",
)


def _shift_right(values: torch.Tensor) -> torch.Tensor:
    """(B, L-1) predictions for tokens 1.. into (B, L) aligned with token positions."""
    return torch.nn.functional.pad(values, (1, 0), value=0.0)


def compute_log_probs(
    model: torch.nn.Module, batch: TrainBatch, *, with_entropy: bool = False, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, L) log-probs of each response token under `model`, and (B, L) entropies when asked.

    Positions outside `batch.response_mask` hold 0 on the chunked path (every loss masks them out).
    `entropy_grad=False`: the entropy is only logged (no entropy bonus), so the chunked path computes it without
    autograd, once per chunk, instead of saving it for the backward pass and recomputing it there.
    """
    device = compute_device(model)
    input_ids = batch.input_ids.to(device)
    attention = batch.attention_mask.to(device)
    images = _image_inputs(model, batch, input_ids)
    head = _chunkable_head(model)
    if head is None:
        logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False, **images).logits
        logits = logits[:, :-1].float()
        log_probs = _shift_right(compute_token_log_probs(logits, input_ids[:, 1:]))
        entropy = _shift_right(compute_entropy_from_logits(logits)) if with_entropy else None
        return log_probs, entropy
    wanted = batch.response_mask.to(device).bool()[:, 1:]
    with _token_head(head, input_ids[:, 1:], wanted, with_entropy, entropy_grad):
        out = model(input_ids=input_ids, attention_mask=attention, use_cache=False, **images).logits
    log_probs = _shift_right(out[..., 0])
    return log_probs, _shift_right(out[..., 1]) if with_entropy else None


def _chunkable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The output head when the model returns its output as the logits (so the chunked path is exact)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:  # a LoRA-wrapped or custom head: whole logits
        return None
    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)]
    for cfg in (c for c in configs if c is not None):
        if any(getattr(cfg, name, None) not in (None, 1, 1.0) for name in _LOGIT_POSTPROCESSING):
            return None
    return head


@contextmanager
def _token_head(
    head: torch.nn.Linear, targets: torch.Tensor, wanted: torch.Tensor, with_entropy: bool, entropy_grad: bool
) -> Iterator[None]:
    """Make `head` return, for hidden states (B, L, H), a (B, L-1, 2) tensor of [log-prob, entropy] per token.

    `targets` (B, L-1): the token each position predicts; `wanted` (B, L-1) bool: the positions to compute.
    """

    def chunk_stats(hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return _token_stats(hidden, head.weight, head.bias, ids, with_entropy)
        both = with_entropy and entropy_grad
        stats = checkpoint(_token_stats, hidden, head.weight, head.bias, ids, both, use_reentrant=False)
        if with_entropy and not entropy_grad:
            with torch.no_grad():
                entropy = _token_stats(hidden, head.weight, head.bias, ids, True)[:, 1]
            stats = torch.stack([stats[:, 0], entropy], dim=1)
        return stats

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden[:, :-1]
        rows, cols = wanted.nonzero(as_tuple=True)
        if (
            rows.numel() == 0
        ):  # nothing to train on: one position keeps the graph (and FSDP's hooks) connected
            rows, cols = rows.new_zeros(1), cols.new_zeros(1)
        picked = hidden[rows, cols]
        ids = targets[rows, cols]
        chunk = max(1, CHUNK_ELEMENTS // head.weight.shape[0])
        stats = torch.cat(
            [chunk_stats(h, t) for h, t in zip(picked.split(chunk), ids.split(chunk), strict=True)]
        )
        out = hidden.new_zeros(*hidden.shape[:2], 2, dtype=torch.float32)
        keep = wanted[rows, cols].unsqueeze(1).to(stats.dtype)  # 0 for the placeholder position
        return out.index_put((rows, cols), stats * keep)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def _token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    with_entropy: bool,
) -> torch.Tensor:
    """(N, 2) float32 [log p(ids), entropy] from N hidden states: one chunk's logits, freed after use."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    log_probs = compute_token_log_probs(logits, ids)
    entropy = compute_entropy_from_logits(logits) if with_entropy else torch.zeros_like(log_probs)
    return torch.stack([log_probs, entropy], dim=1)


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
