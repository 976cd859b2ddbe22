"""The extend step over FlashAttention: an admission's text prefills (agents' next turns over their cached
histories, first turns, parts of long prompts) packed into one run of tokens, attending to their slots' cached
histories where they lie (`flash_attention.py`).

`extend_step` pads every row to the widest (64 tokens, compiled), gathers the rows' slots out of the cache in every
layer and attends with an additive mask of rows x query rows x span: a 16-row forward of ~50-token turns took ~5 ms
on an H200, for ~750 tokens. Here the tokens of all rows follow each other, padded once at the end to a power of
two (a multiple of `WIDTH`), and the per-token parts of a layer (projections, rotary, norms, MLP) see them as
(tokens / WIDTH, WIDTH) rows: the shapes `compiled_extend_step` compiles, so both steps share one compile.

Every sequence of the kernel call is at most `WIDTH` tokens (its grid grows with the longest, `max_q`): a row
longer than that is cut into consecutive sequences of one slot, each attending causally (bottom-right) over the
slot up to its own last token, which every earlier token of the row has already written. The padding tokens
write their keys and values at the cache's sink (the last position, which no sequence reads) and attend, as more
such sequences, over the cache's first positions: every output row is computed, none is left as whatever memory
held (a NaN there would reach the sink, and a masked NaN still poisons a softmax).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from agentrl.rollout.engines import _slot_decode
from agentrl.rollout.engines._fused_projections import LayerFused
from agentrl.rollout.engines._slot_decode import (
    DecodeRegions,
    _rotary,
    layer_output,
    layer_projections,
    text_model,
    through_layers,
)
from agentrl.rollout.engines.flash_attention import FlashRows, flash_cache_attention
from agentrl.rollout.engines.rotary_write import rotary_write, rotary_write_takes

WIDTH = 64
"""Tokens per row of the per-token parts: `EXTEND_MAX_TOKENS`, the width the compiled extend step has."""


def flash_extend_inputs(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    rope_offsets: torch.Tensor | None,
    span: int,
) -> tuple[torch.Tensor, ...]:
    """What every layer of `flash_extend_step` reads: the embedded tokens (R, W, H), them through the first
    layer's input norm, the rotary cos and sin (R, 1, W, D). `span` is unused (the signature of the steps' other
    inputs functions, which the compiled wrapper calls)."""
    inner = text_model(model)
    hidden = inner.embed_tokens(token_ids)
    rope = positions if rope_offsets is None else positions + rope_offsets
    cos, sin = _rotary(model, hidden, rope)
    return hidden, inner.layers[0].input_layernorm(hidden), cos.unsqueeze(1), sin.unsqueeze(1)


def write_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cache_rows: torch.Tensor,
) -> torch.Tensor:
    """Write each token's key and value (R, kv heads, W, D) where `cache_rows` says (`cache_rows_of`: one indexed
    copy each); the queries (R, heads, W, D) as the attention takes them, (tokens, heads, D)."""
    widths, heads, width, head_dim = q.shape
    keys.view(-1, head_dim).index_copy_(0, cache_rows, k.transpose(1, 2).reshape(-1, head_dim))
    values.view(-1, head_dim).index_copy_(0, cache_rows, v.transpose(1, 2).reshape(-1, head_dim))
    return q.transpose(1, 2).reshape(widths * width, heads, head_dim)


def flash_layer(
    layer: torch.nn.Module,
    following_norm: torch.nn.Module,
    hidden: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    rows: FlashRows,
    head_dim: int,
    fused: LayerFused | None,
    cache_rows: torch.Tensor,
    projections: Callable[..., tuple[torch.Tensor, ...]] = layer_projections,
    output: Callable[..., tuple[torch.Tensor, torch.Tensor]] = layer_output,
    only: tuple[torch.Tensor, FlashRows] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer of `flash_extend_step` (`slot_layer`'s signature, so `through_layers` runs it). Where
    `rotary_write` serves it (CUDA, plain projections): the three projections as one matrix multiply (by the
    `fused` weight, else by the three concatenated in this forward), then one kernel adds their biases, rotates,
    writes the cache and lays the queries out; else `projections` and `write_cache`. Then the attention over the
    rows' slots and the `output` part. `projections` and `output` are the compiled parts under
    `compiled_flash_extend_step`. `only`: (flat token indices, `last_token_rows` of them): every token's keys and
    values are written, the rest computed for those tokens only, (R, 1, H) out (the last layer's)."""
    attn = layer.self_attn
    if rotary_write_takes(attn, head_dim, x.device):
        linears = (attn.q_proj, attn.k_proj, attn.v_proj)
        weight = torch.cat([linear.weight for linear in linears]) if fused is None else fused.qkv
        qkv = F.linear(x.reshape(-1, x.shape[-1]), weight)
        biases = None if attn.q_proj.bias is None else tuple(linear.bias for linear in linears)
        heads = attn.q_proj.out_features // head_dim
        cos, sin = cos.reshape(-1, head_dim), sin.reshape(-1, head_dim)
        q = rotary_write(qkv, biases, cos, sin, cache_rows, keys, values, heads)
    else:
        q = write_cache(*projections(layer, x, cos, sin, head_dim, fused), keys, values, cache_rows)
    if only is not None:
        tokens, rows = only
        q = q.index_select(0, tokens)
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, tokens).unsqueeze(1)
    out = flash_cache_attention(q, keys, values, rows, attn.scaling).view(*hidden.shape[:2], -1)
    return output(layer, following_norm, hidden, out, fused)


def last_token_rows(
    token_slots: torch.Tensor, positions: torch.Tensor, last: torch.Tensor, kv_heads: int, length: int
) -> FlashRows:
    """`FlashRows` of one query a row, the token at flat index `last[r]`, over its slot up to its own position:
    made on the device from the step's inputs (a few small kernels, inside its graph)."""
    slots = token_slots.reshape(-1).index_select(0, last)
    reach = positions.reshape(-1).index_select(0, last) + 1
    cu_q = torch.arange(last.shape[0] + 1, dtype=torch.int32, device=last.device)
    cu_k = torch.cat([slots * (kv_heads * length), slots.new_zeros(1)]).to(torch.int32)
    return FlashRows(cu_q, cu_k, reach.to(torch.int32), 1, length)


def cache_rows_of(token_slots: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Where each token's key (or value) of each kv head lies in the cache viewed as (-1, D): (tokens x kv heads,)
    in the tokens' order, the same in every layer (so made once a forward, not indexed per layer)."""
    _, kv_heads, length, _ = cache.shape
    heads = torch.arange(kv_heads, device=token_slots.device)
    return ((token_slots.reshape(-1, 1) * kv_heads + heads) * length + positions.reshape(-1, 1)).view(-1)


@torch.inference_mode()
def flash_extend_step(
    model: torch.nn.Module,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    token_slots: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    last: torch.Tensor,
    rows: FlashRows,
    regions: DecodeRegions | None = None,
    fused: list[LayerFused] | None = None,
) -> torch.Tensor:
    """Feed the packed tokens `token_ids` (T / W, W) at `positions` of slots `token_slots` (same shape); write
    their keys and values; return the logits at the flat token indices `last` (one per row, (R, V)). `rows` says
    which tokens form each row and how much of its slot each reads (`packed_rows`). `fused`: each layer's
    concatenated projection weights (`FusedProjections.layers`), or None."""
    regions = regions or PLAIN_FLASH_REGIONS
    hidden, x, cos, sin = regions.inputs(model, token_ids, positions, None, 0)
    cache_rows = cache_rows_of(token_slots, positions, keys[0])
    inner = text_model(model)
    trims = _slot_decode.TRIM_LAST_LAYER
    hidden, x = through_layers(
        model, regions, keys, values, hidden, x, cos, sin, positions, rows, cache_rows, fused=fused,
        stop=-1 if trims else None,
    )  # fmt: skip
    if not trims:
        return model.lm_head(x.reshape(-1, x.shape[-1]).index_select(0, last))
    # The last layer: every token's keys and values, the rest for the rows' last tokens (`prefill_slots`' too).
    _, kv_heads, length, head_dim = keys[0].shape
    only = (last, last_token_rows(token_slots, positions, last, kv_heads, length))
    _, x = regions.layer(
        inner.layers[-1], inner.norm, hidden, x, cos, sin, keys[-1], values[-1], positions, rows, head_dim,
        None if fused is None else fused[-1], cache_rows, only=only,
    )  # fmt: skip
    return model.lm_head(x.reshape(-1, x.shape[-1]))


PLAIN_FLASH_REGIONS = DecodeRegions(flash_extend_inputs, flash_layer)


def flash_sequences(tokens: int, rows: int) -> int:
    """Sequences of a `flash_extend_step` of `tokens` tokens (a multiple of `WIDTH`) and `rows` rows: enough for
    the rows cut into runs of at most `WIDTH` tokens and the padding's runs. Cutting a row of n tokens makes
    ceil(n / WIDTH) <= 1 + (n - 1) // WIDTH sequences, so the real ones and the padding's number at most
    rows + tokens // WIDTH; the rest are empty."""
    return rows + tokens // WIDTH


def _cut(start: int, count: int) -> list[tuple[int, int]]:
    """(first position, tokens) of the consecutive sequences of at most `WIDTH` tokens a run is cut into."""
    return [(at, min(WIDTH, start + count - at)) for at in range(start, start + count, WIDTH)]


def packed_rows(
    runs: list[tuple[int, int, list[int]]], tokens: int, rows: int, kv_heads: int, length: int, sink: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host inputs of `flash_extend_step` for `runs` (slot, first position, token ids; any length) padded to
    `tokens` tokens and `rows` rows: an int64 (3 x tokens + rows) tensor (token ids, positions, slots, then each
    row's last token index) and `FlashRows.host_arrays` for `flash_sequences` sequences (each run cut into
    sequences of at most `WIDTH` tokens, then the padding's, the rest empty)."""
    lengths = [len(ids) for _, _, ids in runs]
    pad = tokens - sum(lengths)
    if pad < 0 or len(runs) > rows:
        raise ValueError(f"{sum(lengths)} tokens in {len(runs)} rows do not fit {tokens} tokens, {rows} rows")
    if 0 in lengths:  # its logits would be the row's before it
        raise ValueError(f"row {lengths.index(0)} has no tokens to compute")
    ids = [t for _, _, run in runs for t in run] + [0] * pad
    positions = [p for _, start, run in runs for p in range(start, start + len(run))] + [sink] * pad
    slots = [slot for slot, _, run in runs for _ in run] + [runs[0][0] if runs else 0] * pad
    last = [end - 1 for end in itertools.accumulate(lengths)] + [0] * (rows - len(runs))
    cuts = [(slot, *part) for slot, start, run in runs for part in _cut(start, len(run))]
    cuts += [(0, 0, n) for _, n in _cut(0, pad)]  # the padding: each over slot 0's first n positions
    empty = flash_sequences(tokens, rows) - len(cuts)
    sequences = FlashRows.host_arrays(
        [c[0] for c in cuts] + [0] * empty,
        [c[1] for c in cuts] + [0] * empty,
        [c[2] for c in cuts] + [0] * empty,
        kv_heads,
        length,
    )
    return torch.tensor(ids + positions + slots + last), sequences
