"""A left-padded decode batch over one transformers `DynamicCache`: prefill, decode, merge, retire.

Continuous batching needs rows to join and leave between decode steps. Rows are kept
left-aligned-by-padding: row i holds `L - len_i` padding slots and then its real tokens, so a decode
step appends one column for every row at once. Per-row `position_ids` keep RoPE positions right
despite the padding, and the 2-D attention mask hides the padding slots. Joining = prefill the new
prompts as their own batch, left-pad the shorter of the two caches and concatenate along the batch;
leaving = index-select the surviving rows and drop padding columns no row needs any more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class PaddedBatch:
    """KV cache (B rows, L slots), its 2-D mask (B, L) long, and each row's next position (B,) long."""

    cache: DynamicCache
    attention_mask: torch.Tensor
    positions: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.attention_mask.shape[0])

    @property
    def slots(self) -> int:
        return int(self.attention_mask.shape[1])


def _left_pad_kv(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    missing = slots - tensor.shape[-2]
    if missing <= 0:
        return tensor
    pad = tensor.new_zeros(*tensor.shape[:-2], missing, tensor.shape[-1])
    return torch.cat([pad, tensor], dim=-2)


def _left_pad_mask(mask: torch.Tensor, slots: int) -> torch.Tensor:
    missing = slots - mask.shape[1]
    if missing <= 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)


def left_pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded (B, L) id tensor and its (B, L) mask, on `device`."""
    slots = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), slots, dtype=torch.long)
    mask = torch.zeros(len(prompts), slots, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, slots - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, slots - len(prompt) :] = 1
    return input_ids.to(device), mask.to(device)


@torch.inference_mode()
def prefill(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[PaddedBatch, torch.Tensor]:
    """Run the prompts (left-padded together) through the model; return the batch and last logits (B, V)."""
    input_ids, mask = left_pad(prompts, next(model.parameters()).device)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    positions = mask.sum(-1)
    return PaddedBatch(cache=out.past_key_values, attention_mask=mask, positions=positions), out.logits[
        :, -1, :
    ]


@torch.inference_mode()
def decode(model: torch.nn.Module, batch: PaddedBatch, token_ids: list[int]) -> torch.Tensor:
    """Feed one token per row (the last sampled one), grow the cache by one slot; return logits (B, V)."""
    device = batch.attention_mask.device
    input_ids = torch.tensor(token_ids, dtype=torch.long, device=device).unsqueeze(1)
    batch.attention_mask = torch.cat(
        [batch.attention_mask, batch.attention_mask.new_ones(batch.size, 1)], dim=1
    )
    out = model(
        input_ids=input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.positions.unsqueeze(1),
        past_key_values=batch.cache,
        use_cache=True,
    )
    batch.cache = out.past_key_values
    batch.positions = batch.positions + 1
    return out.logits[:, -1, :]


def merge(first: PaddedBatch | None, second: PaddedBatch) -> PaddedBatch:
    """Concatenate two batches along rows (first's rows, then second's), left-padding the shorter one."""
    if first is None or first.size == 0:
        return second
    slots = max(first.slots, second.slots)
    for layer_a, layer_b in zip(first.cache.layers, second.cache.layers, strict=True):
        layer_a.keys = torch.cat(
            [_left_pad_kv(layer_a.keys, slots), _left_pad_kv(layer_b.keys, slots)], dim=0
        )
        layer_a.values = torch.cat(
            [_left_pad_kv(layer_a.values, slots), _left_pad_kv(layer_b.values, slots)], dim=0
        )
    mask = torch.cat(
        [_left_pad_mask(first.attention_mask, slots), _left_pad_mask(second.attention_mask, slots)]
    )
    return PaddedBatch(
        cache=first.cache, attention_mask=mask, positions=torch.cat([first.positions, second.positions])
    )


def select_rows(batch: PaddedBatch, rows: list[int]) -> PaddedBatch | None:
    """Keep only `rows` (in that order; repeats allowed, e.g. for n > 1) and trim shared padding."""
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long, device=batch.attention_mask.device)
    mask = batch.attention_mask.index_select(0, index)
    unused = int((mask.shape[1] - mask.sum(-1)).min())
    for layer in batch.cache.layers:
        layer.keys = layer.keys.index_select(0, index)[..., unused:, :]
        layer.values = layer.values.index_select(0, index)[..., unused:, :]
    return PaddedBatch(
        cache=batch.cache, attention_mask=mask[:, unused:], positions=batch.positions.index_select(0, index)
    )


class DynamicBatch:
    """The engine's running batch over a `DynamicCache`: the path for models `decode_step` cannot serve.

    Same calls as `SlotBatch` (admit, decode, keep, clear), so the scheduler does not know which it drives.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._batch: PaddedBatch | None = None
        self.counters = dict.fromkeys(
            ("prompt_tokens", "prefix_hit_tokens", "prefill_tokens", "prefill_forwards", "prefill_s"), 0
        )
        """As `SlotBatch.counters`; no prefix is reused here, and a left-padded forward computes its padding."""

    @property
    def size(self) -> int:
        return self._batch.size if self._batch is not None else 0

    @property
    def slots(self) -> int:
        return self._batch.slots if self._batch is not None else 0

    def admit(self, prompts: list[list[int]], copies: list[int], reserve: int) -> torch.Tensor:
        self.count_prefill(prompts)
        return self._join(*prefill(self.model, prompts), copies)

    def count_prefill(self, prompts: list[list[int]]) -> None:
        self.counters["prompt_tokens"] += sum(len(p) for p in prompts)
        self.counters["prefill_tokens"] += len(prompts) * max(len(p) for p in prompts)
        self.counters["prefill_forwards"] += 1

    def _join(self, batch: PaddedBatch, logits: torch.Tensor, copies: list[int]) -> torch.Tensor:
        """Add prefilled prompts as rows, prompt i `copies[i]` times; returns the rows' first logits."""
        expand = [i for i, c in enumerate(copies) for _ in range(c)]
        if len(expand) != len(copies):
            batch = select_rows(batch, expand)
            logits = logits[torch.tensor(expand, device=logits.device)]
        self._batch = merge(self._batch, batch)
        return logits

    def decode(self, token_ids: list[int]) -> torch.Tensor:
        return decode(self.model, self._batch, token_ids)

    def keep(self, rows: list[int], finished: dict[int, list[int]] | None = None) -> None:
        """Keep only `rows`; `finished` is ignored (no prefix cache on this path)."""
        self._batch = select_rows(self._batch, rows) if rows else None

    def forget_prefixes(self, keep: int = 0) -> None:
        """Nothing is cached across requests on this path."""

    def clear(self) -> None:
        self._batch = None

    def release_cache(self) -> None:
        """The engine sleeps: drop the rows (this path keeps no cache between steps)."""
        self.clear()

    def weights_changed(self) -> None:
        """Nothing is captured on this path."""
