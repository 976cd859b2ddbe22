"""Forward passes over a TrainBatch: per-token log-probs and entropy (policy), per-token values (critic).

Position t of every output refers to token t: log p(token t | tokens < t) comes from the logits at t - 1,
and the value of token t is the critic's estimate of the state before it (its output at t - 1). Position 0
has no prediction and holds 0; it is never a response token.

Log-probs and entropy are computed inside the model's output head, on response tokens only, a chunk of
tokens at a time, each chunk's logits recomputed in the backward pass (`_ChunkStats`): the (B, L, V) logits
are never materialised, in the compute dtype or in float32 (for a 151,936-token vocabulary, 16 rows x 400
tokens of float32 logits are 3.9 GB, and their softmax and gradient as much again). Prompt and padding
positions, which no loss reads, cost nothing and hold 0. The head's forward is swapped for the duration of the
call (not its module), so FSDP sees the usual forward and its hooks gather and free the head's weight as they
always do. Models whose forward changes the logits after the head (soft-capping, logit scales) keep the
whole-logits path.

The logits are divided by the rollout temperature before every statistic: the engine sampled from
softmax(z / T) and reports that distribution's logprobs, so the trained, old and reference policies are the
tempered one, as in verl's actor and TRL's GRPOTrainer. Training the untempered policy on tempered samples
under-samples its tail, which then grows unseen (docs/algorithms.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from agentrl.algorithms.losses import compute_entropy_from_logits, compute_token_log_probs
from agentrl.training.parallel.fsdp import compute_device
from agentrl.training.update.assembly import TrainBatch

logger = logging.getLogger(__name__)
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
    model: torch.nn.Module,
    batch: TrainBatch,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    compile_head: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, L) log-probs of each response token under softmax(`model`'s logits / `temperature`), and (B, L)
    entropies of that distribution when asked.

    Positions outside `batch.response_mask` hold 0 on the chunked path (every loss masks them out).
    `entropy_grad=False`: the entropy is only logged (no entropy bonus): no gradient flows from it.
    `compile_head`: the chunked path's per-logit math goes through torch.compile (CUDA: one fused pass over each
    chunk's logits instead of ~10; `actor_rollout_ref.actor.use_torch_compile`).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to train on its samples, got {temperature}")
    device = compute_device(model)
    input_ids = batch.input_ids.to(device)
    attention = batch.attention_mask.to(device)
    images = _image_inputs(model, batch, input_ids)
    head = _chunkable_head(model)
    if head is None:
        logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False, **images).logits
        logits = logits[:, :-1].float() / temperature
        log_probs = _shift_right(compute_token_log_probs(logits, input_ids[:, 1:]))
        entropy = _shift_right(compute_entropy_from_logits(logits)) if with_entropy else None
        return log_probs, entropy
    wanted = batch.response_mask.to(device).bool()[:, 1:]
    math = _compiled_math() if compile_head else (logit_stats, logit_grad)
    with _token_head(head, input_ids[:, 1:], wanted, with_entropy, entropy_grad, math, temperature):
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
    head: torch.nn.Linear,
    targets: torch.Tensor,
    wanted: torch.Tensor,
    with_entropy: bool,
    entropy_grad: bool,
    math,
    temperature: float,
) -> Iterator[None]:
    """Make `head` return, for hidden states (B, L, H), a (B, L-1, 2) tensor of [log-prob, entropy] per token.

    `targets` (B, L-1): the token each position predicts; `wanted` (B, L-1) bool: the positions to compute;
    `math`: (`logit_stats`, `logit_grad`), compiled or not; the logits are divided by `temperature` first.
    """

    def chunk_stats(hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # old or reference log-probs: the entropy only when asked
            logits = _tempered(torch.nn.functional.linear(hidden, head.weight, head.bias), temperature)
            _, log_probs, entropy = math[0](logits, ids, with_entropy)
            return torch.stack([log_probs, entropy], dim=1)
        return _ChunkStats.apply(hidden, head.weight, head.bias, ids, entropy_grad, math, temperature)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden[:, :-1]
        rows, cols = wanted.nonzero(as_tuple=True)
        if (
            rows.numel() == 0
        ):  # nothing to train on: one position keeps the graph (and FSDP's hooks) connected
            rows, cols = rows.new_zeros(1), cols.new_zeros(1)
        picked = hidden[rows, cols]
        ids = targets[rows, cols]
        sizes = chunk_sizes(picked.shape[0], max(1, CHUNK_ELEMENTS // head.weight.shape[0]))
        # Each chunk gets its own copy of its ids: a view's storage offset specialises the compiled math (offset
        # 0 and offsets of 2 and more compiled apart, in the first step of every run).
        stats = torch.cat(
            [chunk_stats(h, t.clone()) for h, t in zip(picked.split(sizes), ids.split(sizes), strict=True)]
        )
        out = hidden.new_zeros(*hidden.shape[:2], 2, dtype=torch.float32)
        keep = wanted[rows, cols].unsqueeze(1).to(stats.dtype)  # 0 for the placeholder position
        return out.index_put((rows, cols), stats * keep)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def chunk_sizes(total: int, chunk: int) -> list[int]:
    """`total` positions in chunks of `chunk`, except that a last chunk of one position joins the one before it:
    torch.compile specialises a size of one, so the compiled head math would compile again for it."""
    sizes = [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])
    if len(sizes) > 1 and sizes[-1] == 1:
        sizes[-2:] = [sizes[-2] + 1]
    return sizes


def logit_stats(
    logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N,) float32 log-sum-exp, log p(ids) and entropy (zeros unless `with_entropy`) of (N, V) logits.

    H = lse - sum_v p_v z_v, which needs no log of a zero probability."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    log_probs = z.gather(1, ids.unsqueeze(1)).squeeze(1) - lse
    if not with_entropy:
        return lse, log_probs, torch.zeros_like(lse)
    entropy = lse - (torch.exp(z - lse.unsqueeze(1)) * z).sum(-1)
    return lse, log_probs, entropy


def logit_grad(
    logits: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_log_probs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """The loss's gradient with respect to (N, V) logits, in their dtype, given its gradients with respect to
    log p(ids) and the entropy (N,; None: the entropy is only logged): with log p = z - lse,
        d log p(id) / dz = onehot(id) - p,        d H / dz = -p (log p + H)."""
    log_p = logits.float() - lse.unsqueeze(1)
    p = log_p.exp()
    onehot = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) == ids.unsqueeze(1)
    grad = grad_log_probs.unsqueeze(1) * (onehot.float() - p)
    if grad_entropy is not None:
        grad = grad - grad_entropy.unsqueeze(1) * p * (log_p + entropy.unsqueeze(1))
    return grad.to(logits.dtype)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, in float32 when divided (bf16 would round z / T by up to 2^-8 of z)."""
    return logits if temperature == 1.0 else logits.float() / temperature


_COMPILED_MATH = None


def _compiled_math():
    """`logit_stats` and `logit_grad` through torch.compile, once per process (symbolic in the chunk's size)."""
    global _COMPILED_MATH
    if _COMPILED_MATH is None:
        _COMPILED_MATH = tuple(
            _plain_if_compile_fails(torch.compile(fn, dynamic=True), fn) for fn in (logit_stats, logit_grad)
        )
    return _COMPILED_MATH


def _plain_if_compile_fails(compiled, plain):
    """`compiled`, or from its first failure on (a machine without a working Triton), `plain`, loudly."""
    current = [compiled]

    def call(*args):
        try:
            return current[0](*args)
        except Exception:
            if current[0] is plain:
                raise
            logger.warning(
                "torch.compile of %s failed; using the plain function "
                "(actor_rollout_ref.actor.use_torch_compile=false skips compiling)",
                plain.__name__,
                exc_info=True,
            )
            current[0] = plain
            return plain(*args)

    return call


class _ChunkStats(torch.autograd.Function):
    """[log p(ids), entropy] (N, 2) of one chunk of hidden states, with a backward that recomputes its logits.

    The forward computes the logits once for both numbers and keeps only the hidden states, the log-sum-exp and
    the entropy; the backward recomputes the logits (one matmul) and forms their gradient directly
    (`logit_grad`). Checkpointing the autograd graph instead ran the chunk's forward twice (three times with a
    logged-only entropy), and autograd's log-softmax backward made several more passes over the (N, V) logits.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, entropy_grad: bool, math, temperature: float):
        device_type = hidden.device.type  # the backward recomputes the logits under the forward's autocast
        ctx.autocast = (
            (device_type, torch.get_autocast_dtype(device_type))
            if torch.is_autocast_enabled(device_type)
            else None
        )
        logits = _tempered(torch.nn.functional.linear(hidden, weight, bias), temperature)
        lse, log_probs, entropy = math[0](logits, ids)
        ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy)
        ctx.entropy_grad, ctx.math, ctx.temperature = entropy_grad, math, temperature
        return torch.stack([log_probs, entropy], dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.autocast is None:
            return _ChunkStats._backward(ctx, grad_out)
        with torch.autocast(ctx.autocast[0], dtype=ctx.autocast[1]):
            return _ChunkStats._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        hidden, weight, bias, ids, lse, entropy = ctx.saved_tensors
        grad_entropy = grad_out[:, 1].contiguous() if ctx.entropy_grad else None
        logits = _tempered(torch.nn.functional.linear(hidden, weight, bias), ctx.temperature)
        grad = ctx.math[1](logits, ids, lse, entropy, grad_out[:, 0].contiguous(), grad_entropy)
        if ctx.temperature != 1.0:  # d(z / T) / dz = 1 / T, back in the weights' dtype
            grad = (grad / ctx.temperature).to(weight.dtype)
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


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
