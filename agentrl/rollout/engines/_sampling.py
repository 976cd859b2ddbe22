"""Per-row token selection for a batch whose rows carry different sampling settings.

Why per row: the OpenAI API lets every request choose temperature, top_p, top_k and seed, and one
decode step of the embedded engine mixes rows of many requests. Filtering (temperature, top-k,
top-p) is vectorised over the batch; the final draw is done per row with that row's own
`torch.Generator`, so a seeded request gives the same tokens whatever else shares its batch.

Logprobs are always the log-softmax of the RAW logits (before temperature, top-k, top-p) at the
chosen token: the log-probability of the token under the policy itself, which is what PPO/GRPO
importance ratios need (verl and vLLM's default `logprobs_mode="raw_logprobs"` do the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowSampling:
    """The sampling settings of one batch row (one completion of one request)."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class StepResult:
    """What one decode step chose for every row: token ids (B,), raw logprobs (B,), optional tops."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


def filter_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering, per row.

    logits (B, V) float; temperature (B,) > 0; top_p (B,) in (0, 1]; top_k (B,) long, <= 0 = off.
    Returns processed logits (B, V) with removed tokens at -inf. The most likely token always
    survives, so every row keeps at least one candidate.
    """
    scaled = logits / temperature.unsqueeze(1)
    vocab = scaled.shape[-1]
    needs_k = bool(((top_k > 0) & (top_k < vocab)).any())
    needs_p = bool((top_p < 1.0).any())
    if not needs_k and not needs_p:
        return scaled
    sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if needs_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
        remove |= rank >= k
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    if needs_p:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove |= mass_before > top_p.unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, sorted_idx, sorted_logits)


def select_tokens(logits: torch.Tensor, rows: list[RowSampling]) -> StepResult:
    """Choose the next token of every row and report its raw logprob (and top-k raw logprobs).

    logits (B, V): the model's last-position logits, any float dtype (computed in float32).
    Greedy rows (temperature 0) take the argmax of the raw logits, like `generate(do_sample=False)`.
    """
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    chosen = torch.argmax(logits, dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        dev = logits.device
        temperature = torch.tensor([rows[i].temperature for i in sampled], device=dev, dtype=torch.float32)
        top_p = torch.tensor([rows[i].top_p for i in sampled], device=dev, dtype=torch.float32)
        top_k = torch.tensor([rows[i].top_k for i in sampled], device=dev, dtype=torch.long)
        probs = torch.softmax(filter_logits(logits[idx], temperature, top_p, top_k), dim=-1)
        for j, i in enumerate(sampled):
            chosen[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
    token_lp = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    tops: list[dict[int, float] | None] = [None] * len(rows)
    max_top = max((row.top_logprobs for row in rows), default=0)
    if max_top > 0:
        values, indices = torch.topk(raw_logprobs, k=min(max_top, raw_logprobs.shape[-1]), dim=-1)
        values, indices = values.tolist(), indices.tolist()
        for i, row in enumerate(rows):
            if row.top_logprobs > 0:
                k = row.top_logprobs
                tops[i] = dict(zip(indices[i][:k], values[i][:k], strict=True))
    return StepResult(token_ids=chosen.tolist(), logprobs=token_lp.tolist(), top_logprobs=tops)
