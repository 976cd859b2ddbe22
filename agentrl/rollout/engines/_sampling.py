"""Per-row token selection for a batch whose rows carry different sampling settings, on the device.

Why per row: the OpenAI API lets every request choose temperature, top_p, top_k and seed, and one
decode step of the embedded engine mixes rows of many requests. Filtering (temperature, top-k,
top-p) and the draw are vectorised over the batch, so a step costs a handful of kernels and one
copy to the host, whatever the batch size.

A draw depends only on the completion's seed and the token's position in it: the uniform number
behind inverse-CDF sampling comes from a counter-based hash of (seed, position) (splitmix64 in
wrapping 64-bit integer arithmetic, on the device; `uniform_draw` is the same hash in Python integers,
the reference), not from a stateful generator. A seeded request therefore gives the same tokens
whatever else shares its batch, on any device, and a resumed run redraws what the uninterrupted one
drew.

Two entry points: `select_tokens` serves any mix of rows (blocked tokens, grammars, top logprobs) and
brings the result to the host at once; `sample_on_device` serves plain rows whose settings already
live on the device, and leaves tokens there, so the engine can launch the next decode step before it
reads them (`_slot_batch.SlotBatch.decode_sampled`).

Logprobs are the log-softmax of the logits divided by the row's temperature (greedy rows: the raw
logits), before top-k, top-p and the min_tokens mask, at the chosen token: log softmax(z / T), the
policy the trainer trains (`training/update/forward.py` divides its logits by the rollout temperature, as
verl's actor and TRL's GRPOTrainer do). vLLM reports the same with `logprobs_mode="processed_logprobs"`
(which verl sets by default) when top_p = 1 and top_k is off; its default `raw_logprobs` is before temperature.

A row may also carry an allowed-token bitmask (constrained decoding, `constraints.py`): tokens outside
it are removed from the choice logits before filtering and the draw, like blocked tokens. The
reported logprob stays the unmasked one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class RowSampling:
    """The sampling settings of one batch row (one completion of one request)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    """The completion's seed: with `position`, all its draw depends on."""
    position: int = 0
    """Index of the token being drawn within the completion."""
    top_logprobs: int = 0
    blocked_token_ids: tuple[int, ...] = ()
    """Tokens this row cannot choose: EOS and stop tokens below `min_tokens` (vLLM's rule); logprobs stay unmasked."""
    allowed: torch.Tensor | None = None
    """Constrained rows only: (ceil(V / 32),) int32 bitmask, bit b of word w allows token 32 * w + b
    (llguidance's layout); every other token is removed before the draw. None = unconstrained."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class StepResult:
    """What one decode step chose for every row: token ids (B,), tempered logprobs (B,), optional tops."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def uniform_draw(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position) (reference for `uniform_draws`)."""
    mixed = _splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64)
    return (mixed >> 11) / float(1 << 53)


def as_int64(value: int) -> int:
    """The 64-bit pattern of `value` (taken modulo 2^64) as a signed int64, the form a torch.long holds."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


_GOLDEN, _MIX1, _MIX2 = (as_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values: torch's `>>` on signed integers is arithmetic."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """`_splitmix64` on int64 tensors: additions and products wrap modulo 2^64 like the masked Python ones."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniform_draws(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`uniform_draw` element-wise on the device: int64 seeds (`as_int64`) and positions -> float32, equal
    bit for bit to the Python reference rounded to float32."""
    mixed = _splitmix64_tensor(_splitmix64_tensor(seeds) + positions)
    return (_shift_right(mixed, 11).double() / float(1 << 53)).float()


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    *,
    needs: tuple[bool, bool] | None = None,
) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering, per row.

    logits (B, V) float; temperature (B,) > 0; top_p (B,) in (0, 1]; top_k (B,) long, <= 0 = off.
    `needs`: whether any row filters by top-k and by top-p, when the caller knows (saves a host sync).
    Returns processed logits (B, V) with removed tokens at -inf. The most likely token always
    survives, so every row keeps at least one candidate.
    """
    scaled = logits / temperature.unsqueeze(1)
    vocab = scaled.shape[-1]
    if needs is None:
        needs = (bool(((top_k > 0) & (top_k < vocab)).any()), bool((top_p < 1.0).any()))
    needs_k, needs_p = needs
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


def _unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """(k, W) int32 bitmask -> (k, vocab) bool; tokens past 32 * W are not allowed."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] < vocab:
        return torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)
    return bits[:, :vocab]


def _apply_allowed(choice_logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Remove, in the rows that carry a bitmask, every token it does not allow (-inf)."""
    constrained = [i for i, row in enumerate(rows) if row.allowed is not None]
    if not constrained:
        return choice_logits
    dev = choice_logits.device
    words = torch.stack([rows[i].allowed for i in constrained]).to(dev)
    allowed = _unpack_bitmask(words, choice_logits.shape[-1])
    idx = torch.tensor(constrained, device=dev)
    return choice_logits.index_copy(0, idx, choice_logits[idx].masked_fill(~allowed, float("-inf")))


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids drawn from each row of `probs` (B, V) with the given uniforms (B,)."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total mass, so the first cdf entry above it belongs to a token with mass.
    targets = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def policy_log_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(B, V) log softmax(z / T) of float logits, T the row's temperature (1 for greedy rows): the logprobs
    the engine reports."""
    divisor = torch.where(temperature <= 0.0, torch.ones_like(temperature), temperature)
    return torch.log_softmax(logits / divisor.unsqueeze(1), dim=-1)


def policy_logprob(logits: torch.Tensor, temperature: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """(B,) `policy_log_softmax` at each row's chosen token."""
    return policy_log_softmax(logits.float(), temperature).gather(1, chosen.unsqueeze(1)).squeeze(1)


def select_tokens(logits: torch.Tensor, rows: list[RowSampling]) -> StepResult:
    """Choose the next token of every row and report its logprob (and top logprobs) under log softmax(z / T).

    logits (B, V): the model's last-position logits, any float dtype (computed in float32).
    Greedy rows (temperature 0) take the argmax of the raw logits, like `generate(do_sample=False)`.
    """
    logits = logits.float()
    dev = logits.device
    temperatures = torch.tensor([r.temperature for r in rows], device=dev, dtype=torch.float32)
    policy_logprobs = policy_log_softmax(logits, temperatures)
    choice_logits = logits
    blocked = [
        (i, t) for i, row in enumerate(rows) for t in row.blocked_token_ids if 0 <= t < logits.shape[-1]
    ]
    if blocked:
        choice_logits = logits.clone()
        row_idx, token_idx = torch.tensor(blocked, device=dev).unbind(1)
        choice_logits[row_idx, token_idx] = float("-inf")
    choice_logits = _apply_allowed(choice_logits, rows)
    chosen = torch.argmax(choice_logits, dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=dev)
        settings = [rows[i] for i in sampled]
        temperature = torch.tensor([r.temperature for r in settings], device=dev, dtype=torch.float32)
        top_p = torch.tensor([r.top_p for r in settings], device=dev, dtype=torch.float32)
        top_k = torch.tensor([r.top_k for r in settings], device=dev, dtype=torch.long)
        uniforms = uniform_draws(
            torch.tensor([as_int64(r.seed) for r in settings], device=dev),
            torch.tensor([r.position for r in settings], device=dev),
        )
        part = choice_logits if len(sampled) == len(rows) else choice_logits[idx]
        probs = torch.softmax(filter_logits(part, temperature, top_p, top_k), dim=-1)
        chosen = chosen.index_copy(0, idx, _inverse_cdf(probs, uniforms))
    token_lp = policy_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    # One copy to the host for the whole step (token ids < 2^24 are exact in float64 and in float32).
    host = torch.stack([chosen.double(), token_lp.double()]).cpu()
    token_ids = [int(t) for t in host[0].tolist()]
    tops: list[dict[int, float] | None] = [None] * len(rows)
    max_top = max((row.top_logprobs for row in rows), default=0)
    if max_top > 0:
        values, indices = torch.topk(policy_logprobs, k=min(max_top, policy_logprobs.shape[-1]), dim=-1)
        values, indices = values.tolist(), indices.tolist()
        for i, row in enumerate(rows):
            if row.top_logprobs > 0:
                k = row.top_logprobs
                tops[i] = dict(zip(indices[i][:k], values[i][:k], strict=True))
    return StepResult(token_ids=token_ids, logprobs=host[1].tolist(), top_logprobs=tops)


def filters_needed(top_k: list[int], top_p: list[float], vocab: int) -> tuple[bool, bool]:
    """Whether any row filters by top-k, and whether any by top-p (`filter_logits`'s `needs`)."""
    return any(0 < k < vocab for k in top_k), any(p < 1.0 for p in top_p)


def sample_on_device(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    needs: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's next token and its logprob under log softmax(z / T), left on the device (no host sync).

    For rows without blocked tokens, grammars or top logprobs; the draw equals `select_tokens`' for the same
    (seed, position). Greedy rows (temperature <= 0) take the argmax of the raw logits.
    """
    logits = logits.float()
    greedy = temperature <= 0.0
    scaled = filter_logits(logits, torch.where(greedy, 1.0, temperature), top_p, top_k, needs=needs)
    drawn = _inverse_cdf(torch.softmax(scaled, dim=-1), uniform_draws(seeds, positions))
    chosen = torch.where(greedy, torch.argmax(logits, dim=-1), drawn)
    return chosen, policy_logprob(logits, temperature, chosen)
