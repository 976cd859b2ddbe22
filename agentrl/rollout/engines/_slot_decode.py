"""One decode step of a Llama-family model over a preallocated slot cache, with fixed shapes.

Why not the model's own forward: transformers' decode with a `DynamicCache` re-concatenates every
layer's keys and values at each step and builds its masks on the host, so a step has shapes that
change every token and cannot be captured as a CUDA graph; at batch 128 a 0.5B model spent ~20 ms
per step where its weights take ~0.5 ms to read. Here each sequence owns a slot (a row of the
cache) and writes its key and value at its own position; the attention reads the whole slot and
masks positions past the row's own. Shapes depend only on the batch bucket, so the engine captures
one CUDA graph per bucket and replays it.

The step reuses the model's own modules (embeddings, norms, projections, MLP, rotary embedding), so
in-place weight updates and merged LoRA adapters are served as they are, and the arithmetic is the
model's: logprobs match a teacher-forced forward of the same weights. Supported: the architectures
in `SLOT_DECODE_ARCHITECTURES` with full attention and a position-independent rotary embedding.
Others (sliding windows, dynamic RoPE) use the `DynamicCache` path.

Vision-language models (`MROPE_ARCHITECTURES`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) run their language model here.
Their multimodal rotary position (t, h, w) differs from the cache index only at prefill: image tokens get 3-D
positions, and text after an image continues from the image's largest position. So a prefill with images takes
each token's three components and the image features (`PackedVision`, built by `vision.py`), and every later
token of the sequence, all three components equal, sits at its cache index plus the sequence's constant
offset (transformers' `rope_deltas`): decode and extend steps take that one integer per slot (`rope_offsets`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from agentrl.rollout.engines._fused_projections import LayerFused, mlp_output, project_qkv
from agentrl.rollout.engines.shared_prefix_attention import SharedPrefix, SharedPrefixMask

MROPE_ARCHITECTURES = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
)
SLOT_DECODE_ARCHITECTURES = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    *MROPE_ARCHITECTURES,
)
_STATIC_ROPE_TYPES = (None, "default", "linear", "llama3", "yarn")


def text_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb): a vision-language model's language model."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def text_config(model: torch.nn.Module):
    """The language model's config (a vision-language config nests it as `text_config`)."""
    return getattr(model.config, "text_config", None) or model.config


@dataclass
class PackedVision:
    """What images change in one packed prefill forward (`prefill_slots`) of N tokens."""

    rope_positions: torch.Tensor
    """(3, N) long: each token's multimodal rotary position (t, h, w); equal components for text."""
    mask: torch.Tensor
    """(N,) bool: the image pad tokens, whose embeddings the image features replace."""
    embeds: torch.Tensor
    """(pads, H): the vision tower's features of the masked tokens, in order."""
    deepstack: list[torch.Tensor]
    """Qwen3-VL: per early decoder layer, (pads, H) added to the masked tokens' hidden states after that layer."""


@dataclass(frozen=True)
class KVShape:
    """What one token of one sequence occupies in the cache, per layer."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: torch.nn.Module) -> KVShape:
        cfg = text_config(model)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = model.get_input_embeddings().weight.dtype
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, dtype)

    def bytes_per_token(self) -> int:
        return (
            2 * self.layers * self.kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()
        )


def slot_decode_unsupported(model: torch.nn.Module) -> str | None:
    """Why `decode_step` cannot serve `model` (None when it can)."""
    name = type(model).__name__
    if name not in SLOT_DECODE_ARCHITECTURES:
        return f"{name} is not one of {', '.join(SLOT_DECODE_ARCHITECTURES)}"
    cfg = text_config(model)
    if any(kind != "full_attention" for kind in getattr(cfg, "layer_types", None) or ()):
        return "some layers use sliding-window attention"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "the model uses sliding-window attention"
    rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type not in _STATIC_ROPE_TYPES or (_mrope(model) and name not in MROPE_ARCHITECTURES):
        return f"rope type {rope_type!r} is not position-independent"
    inner = text_model(model) if hasattr(model, "model") else None
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, attr) for attr in needed):
        return f"{name} lacks model.{{{', '.join(needed)}}}"
    return None


def _mrope(model: torch.nn.Module) -> dict | None:
    """The text config's rope parameters when they hold multimodal sections (`mrope_section`), else None."""
    cfg = text_config(model)
    rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
    return rope if isinstance(rope, dict) and "mrope_section" in rope else None


def _rotary(model: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor):
    """cos, sin (..., D) of the model's rotary embedding at `positions`: text positions shaped like `hidden`'s
    leading dims, or an image prompt's multimodal positions (3, ...).

    A multimodal (mrope) rotary always gets its three components (text positions broadcast: all three equal),
    the layout every transformers release accepts. transformers 5.24's Qwen2-VL rotary then mixes the sections
    itself; 5.17's (the GPU image's) returns them unmixed, (3, ..., D), and leaves the mixing to its attention:
    it is done here then, section by section as that attention does (component i % 3 for the i-th section of
    mrope_section repeated twice, the two rotated halves)."""
    inner = text_model(model)
    mrope = _mrope(model)
    if mrope is None:
        return inner.rotary_emb(hidden, positions)
    if positions.dim() == hidden.dim() - 1:
        positions = positions.unsqueeze(0).expand(3, *positions.shape)
    cos, sin = inner.rotary_emb(hidden, positions)
    if cos.dim() == positions.dim() + 1:  # (3, ..., D): unmixed
        if mrope.get("mrope_interleaved"):
            raise NotImplementedError("an interleaved mrope rotary that returns unmixed components")
        sections = list(mrope["mrope_section"]) * 2
        cos, sin = (
            torch.cat([part[i % 3] for i, part in enumerate(t.split(sections, dim=-1))], dim=-1)
            for t in (cos, sin)
        )
    return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, heads, 1, D): x*cos + rotate_half(x)*sin, rotate_half = (-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attention_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A decode step's `attn_mask` from the boolean `visible`: additive on the CPU (`_additive_mask`), elsewhere
    the boolean as it is (one row of keys per sequence: small)."""
    return _additive_mask(visible, dtype) if visible.device.type == "cpu" else visible


def _additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's `attn_mask` from the boolean `visible`, as an additive mask made once per forward: SDPA converts a
    boolean mask in every layer's call. On one CPU core a 32-row prefill's attention took 23 ms a layer with the
    boolean mask and 15 ms with this one. On an H100 (0.5B shape, bf16) 32 rows x 64 tokens over 1,024 cached
    took 9.5 instead of 11.0 ms, 32 prompts of 256 tokens 31.8 instead of 37.9 ms (`benchmarks/prefill_speed.py`)."""
    blank = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return blank.masked_fill_(~visible, float("-inf"))


def _grouped_mask(visible: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """(R, W, S) boolean -> the additive mask of attention with a kv head's query heads as its query rows:
    (R, 1, groups x W, S), each head group's W rows the same."""
    rows, width, span = visible.shape
    mask = _additive_mask(visible, dtype).unsqueeze(1).expand(rows, groups, width, span)
    return mask.reshape(rows, 1, groups * width, span)


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """A decode step's attention: a kv head's few query rows (its query heads) over the cached positions.

    On the CPU in float32 as two matrix products around a softmax, with the additive mask: PyTorch's CPU kernel
    for scaled-dot-product attention works in blocks of query rows and took 1.3-1.8x as long with two rows a kv
    head (32 rows over 640 positions, head size 32), 1.1-1.2x with three and about the same with seven
    (`benchmarks/decode_attention.py`); logprobs still equal teacher forcing. Elsewhere (CUDA graphs, fused
    kernels) and in lower precision (whose softmax the kernel takes in float32) scaled-dot-product attention."""
    if query.device.type != "cpu" or query.dtype != torch.float32:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=attn_mask, scale=scale)
    scores = torch.matmul(query, keys.transpose(-1, -2)).mul_(scale).add_(attn_mask)
    return torch.matmul(torch.softmax(scores, dim=-1), values)


def _heads(projected: torch.Tensor, head_dim: int, norm: torch.nn.Module | None) -> torch.Tensor:
    """(B, W, heads*D) -> (B, heads, W, D), with the per-head norm of Qwen3-style attention."""
    states = projected.view(projected.shape[0], projected.shape[1], -1, head_dim)
    if norm is not None:
        states = norm(states)
    return states.transpose(1, 2)


def decode_inputs(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    rope_offsets: torch.Tensor | None,
    length: int,
) -> tuple[torch.Tensor, ...]:
    """What every layer of `decode_step` reads: the embedded tokens (b, 1, H), them through the first layer's
    input norm, the rotary cos and sin (b, 1, 1, D) and the attention mask over `length` cache positions."""
    inner = text_model(model)
    hidden = inner.embed_tokens(token_ids.unsqueeze(1))
    rope = positions if rope_offsets is None else positions + rope_offsets
    cos, sin = _rotary(model, hidden, rope.unsqueeze(1))  # (b, 1, D)
    # No size read into a Python int: compiled, the code after the rotary call's graph break would hold the
    # rows as a constant and compile again for every batch bucket.
    visible = (torch.arange(length, device=token_ids.device) <= positions[:, None])[:, None, None, :]
    x = inner.layers[0].input_layernorm(hidden)
    return hidden, x, cos.unsqueeze(1), sin.unsqueeze(1), _attention_mask(visible, hidden.dtype)


class DecodeRegions(NamedTuple):
    """The two pieces `decode_step` (or `extend_step`) runs: its inputs (`decode_inputs`, `extend_inputs`) and
    each decoder layer (`slot_layer`), as plain functions or compiled once (`compiled_decode_step` compiles
    `slot_layer` whole, `compiled_extend_step` its parts around the cache)."""

    inputs: Callable[..., tuple[torch.Tensor, ...]]
    layer: Callable[..., tuple[torch.Tensor, torch.Tensor]]


@torch.inference_mode()
def decode_step(
    model: torch.nn.Module,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    rope_offsets: torch.Tensor | None = None,
    span: int | None = None,
    regions: DecodeRegions | None = None,
    fused: list[LayerFused] | None = None,
    shared: SharedPrefix | None = None,
) -> torch.Tensor:
    """Feed token_ids[i] at positions[i] of slot i (i < b); write its keys and values; return logits (b, V).

    keys[l] / values[l]: (slots, kv_heads, length, D); slot i attends to its positions 0..positions[i].
    `rope_offsets` (b,) long: the rotary position is positions[i] + rope_offsets[i] (a multimodal sequence's
    offset after its images; broadcast to the three mrope components). `span`: attention reads only cache
    positions 0..span-1, which must hold every running row's position (idle slots write past it, unread).
    `regions`: the functions that run its parts (default: the plain ones). `fused`: `FusedProjections.layers`.
    `shared`: how the slots share a prompt prefix (`plan_shared_prefix`; the plain regions' float32 CPU step).
    """
    regions = regions or PLAIN_REGIONS
    length = keys[0].shape[2] if span is None else span
    hidden, x, cos, sin, visible = regions.inputs(model, token_ids, positions, rope_offsets, length)
    if shared is not None:
        visible = SharedPrefixMask(visible, shared)
    _, x = through_layers(model, regions, keys, values, hidden, x, cos, sin, positions, visible, fused=fused)
    return model.lm_head(x)[:, 0]


def through_layers(
    model: torch.nn.Module,
    regions: DecodeRegions,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    hidden: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    visible: object,
    *slots: torch.Tensor,
    fused: list[LayerFused] | None = None,
    stop: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers of a step before `stop` (default: all), `regions.layer` on each layer's cache; the
    residual stream and it through the next layer's input norm (after the last layer, the final norm).
    `visible`: what the layer's cache part reads to know which positions each row sees (a mask, or
    `_flash_extend`'s `FlashRows`); `slots`: `extend_step`'s slot of each row, or `flash_extend_step`'s cache
    rows of each token (`cache_rows_of`); `fused`: each layer's concatenated projection weights
    (`FusedProjections.layers`), or None to multiply by the modules' own."""
    head_dim = KVShape.of(model).head_dim
    inner = text_model(model)
    layers = inner.layers
    for index, layer in enumerate(layers[:stop]):
        following = layers[index + 1].input_layernorm if index + 1 < len(layers) else inner.norm
        hidden, x = regions.layer(
            layer, following, hidden, x, cos, sin, keys[index], values[index], positions, visible, head_dim,
            None if fused is None else fused[index], *slots,
        )  # fmt: skip
    return hidden, x


def slot_layer(
    layer: torch.nn.Module,
    following_norm: torch.nn.Module,
    hidden: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    visible: torch.Tensor,
    head_dim: int,
    fused: LayerFused | None = None,
    slot_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer of `decode_step` or `extend_step` (`_flash_extend.flash_layer` is `flash_extend_step`'s):
    `x` is `hidden` (R, W, H) after the layer's input norm. Writes the rows' keys and values into this layer's
    cache at their positions, attends over the first `visible.shape[-1]` positions; returns the residual stream
    and it through `following_norm` (the next layer's input norm, or the final norm), so the residual add and the
    next norm stay one fused kernel when compiled.

    A decode step (`slot_ids` None): row i is slot i and feeds one token, `positions` (R,). An extend step: row r
    feeds W tokens at `positions` (R, W) of slot `slot_ids[r]`, and attends to a copy of that slot's cache.

    A function of its own so that torch.compile traces one layer and reuses it for all (every layer has the
    same code; the layer's weights are inputs of the compiled graph): tracing a 24-layer step took 33-71 s in
    every process (`benchmarks/decode_compile.py`). Its three parts are functions too, so that a compiled extend
    step compiles the two around the cache and runs the cache's part as it is (`compiled_extend_step`)."""
    q, k, v = layer_projections(layer, x, cos, sin, head_dim, fused)
    out = cache_attention(q, k, v, keys, values, positions, visible, layer.self_attn.scaling, slot_ids)
    return layer_output(layer, following_norm, hidden, out, fused)


def layer_projections(
    layer: torch.nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    fused: LayerFused | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`slot_layer`'s queries, keys and values of `x` (R, W, H), each (R, heads, W, D), rotated."""
    attn = layer.self_attn
    q, k, v = project_qkv(attn, x, fused)
    q = _rotate(_heads(q, head_dim, getattr(attn, "q_norm", None)), cos, sin)
    k = _rotate(_heads(k, head_dim, getattr(attn, "k_norm", None)), cos, sin)
    return q, k, _heads(v, head_dim, None)


def cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    slot_ids: torch.Tensor | None,
) -> torch.Tensor:
    """`slot_layer`'s part that touches the cache: write the rows' keys and values at their positions, attend
    over the first `visible.shape[-1]` positions of their slots; the attention's output (R, W, heads x D).
    A decode step's `visible` may be a `SharedPrefixMask`: the rows' shared prompt prefix is read once a group."""
    shared = None
    if isinstance(visible, SharedPrefixMask):
        visible, shared = visible
    rows, width, head_dim, length = q.shape[0], q.shape[2], q.shape[3], visible.shape[-1]
    if slot_ids is None:
        slots = torch.arange(rows, device=q.device)
        keys[slots, :, positions] = k[:, :, 0]
        values[slots, :, positions] = v[:, :, 0]
        cached_keys, cached_values = keys[:rows, :, :length], values[:rows, :, :length]
    else:
        slots = slot_ids.unsqueeze(1)
        keys[slots, :, positions] = k.transpose(1, 2)
        values[slots, :, positions] = v.transpose(1, 2)
        cached_keys = keys[:, :, :length].index_select(0, slot_ids)
        cached_values = values[:, :, :length].index_select(0, slot_ids)
    # Grouped-query attention without repeating keys: a kv head's query heads act as its query rows.
    grouped = q.reshape(rows, keys.shape[1], -1, head_dim)
    if shared is not None:
        out = shared.attend(grouped, keys, values, visible, scale)
    else:
        attend = decode_attention if slot_ids is None else F.scaled_dot_product_attention
        out = attend(grouped, cached_keys, cached_values, attn_mask=visible, scale=scale)
    return out.reshape(rows, -1, width, head_dim).transpose(1, 2).reshape(rows, width, -1)


def layer_output(
    layer: torch.nn.Module,
    following_norm: torch.nn.Module,
    hidden: torch.Tensor,
    out: torch.Tensor,
    fused: LayerFused | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`slot_layer`'s rest after attention: the output projection, the MLP, both residual adds; the residual
    stream and it through `following_norm`."""
    hidden = hidden + layer.self_attn.o_proj(out)
    hidden = hidden + mlp_output(layer.mlp, layer.post_attention_layernorm(hidden), fused)
    return hidden, following_norm(hidden)


PLAIN_REGIONS = DecodeRegions(decode_inputs, slot_layer)
TRIM_LAST_LAYER = True
"""Whether the prefill forwards' last layer (`prefill_slots`', `flash_extend_step`'s) computes only the rows' last
tokens past its cache write (False: every token, as before). On 2 CPU cores `tiny:qwen2`'s prefill of 32 rows took
1.18x less time (`benchmarks/last_layer_prefill.py`); on an H200 the 0.5B shape's forwards of up to 768 tokens
took the same time either way (the layer's multiplies over 16 rows are bound by reading its weights, as over
576 tokens) and 2.5-3.5% less from 1,536 tokens up (`benchmarks/prefill_forward.py --whole-last-layer`)."""


@torch.inference_mode()
def prefill_slots(
    model: torch.nn.Module,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    slots: list[int],
    starts: list[int],
    chunks: list[list[int]],
    vision: PackedVision | None = None,
    to_device: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fused: list[LayerFused] | None = None,
    shared: SharedPrefix | None = None,
) -> torch.Tensor:
    """Feed `chunks[r]` at positions starts[r].. of slot slots[r]; write their keys and values; return the
    logits of each chunk's last token (rows, V). `to_device`: how a host tensor reaches the model's device
    (default `.to(device)`; the engine's copies through pinned memory wait for nothing queued before them).

    Packed: the projections and MLPs run over the chunks' tokens concatenated, with no padding, and each chunk
    attends to what its slot already holds (positions 0..starts[r]-1: a reused prefix, or an earlier chunk of
    the same prompt) and causally to itself. Only attention pads, to the longest chunk: one SDPA call over
    (rows, kv heads, query heads per kv head x widest chunk, keys) with a mask for each row's own positions.
    `vision`: a vision-language model's image features and rotary positions for these tokens. `fused`: as
    `decode_step`'s. `shared`: how the rows (as its slots) share a prefix they all hold already
    (`plan_shared_prefix` over their cached parts): each group's queries attend over one row's copy of it
    without a mask, and over their own positions past it under the mask (`SharedPrefix.attend_prefill`).

    The last layer writes every token's keys and values but computes the rest (attention, output projection,
    MLP) for each row's last token only, the one whose logits are returned: vLLM and transformers run it for
    every token and keep the last. For `tiny:qwen2` (4 layers) that is a quarter of the forward; a 24-layer
    model's 1/24 (`benchmarks/last_layer_prefill.py`).
    """
    inner = text_model(model)
    shape = KVShape.of(model)
    device = keys[0].device
    lengths = [len(chunk) for chunk in chunks]
    rows, total, widest = len(chunks), sum(lengths), max(lengths)
    span = max(start + n for start, n in zip(starts, lengths, strict=True))
    to_device = to_device or (lambda host: host.to(device))
    # Two host tensors built from Python lists, two copies: `torch.tensor(..., device=cuda)` from pageable memory
    # waits for the work queued before it (the decode step launched ahead, then this forward's own layers).
    ids, row_of, offset = to_device(
        torch.tensor(
            [
                [t for chunk in chunks for t in chunk],
                [row for row, n in enumerate(lengths) for _ in range(n)],
                [i for n in lengths for i in range(n)],
            ]
        )
    )
    ends = list(itertools.accumulate(lengths))
    start_of_row, slot_of_row, last = to_device(torch.tensor([starts, slots, [end - 1 for end in ends]]))
    positions = start_of_row[row_of] + offset
    slot_of = slot_of_row[row_of]
    heads = text_config(model).num_attention_heads
    groups = heads // shape.kv_heads
    query_positions = start_of_row.unsqueeze(1) + torch.arange(widest, device=device).unsqueeze(0)
    visible = torch.arange(span, device=device).view(1, 1, span) <= query_positions.unsqueeze(2)
    hidden = inner.embed_tokens(ids.unsqueeze(0))  # (1, N, H)
    every_token = _PrefillQueries(
        row_of, offset, widest, _prefill_mask(visible, groups, hidden.dtype, shared)
    )
    each_row = torch.arange(rows, device=device)
    last_visible = visible[each_row, offset.index_select(0, last)].unsqueeze(1)  # (rows, 1, span)
    last_only = _PrefillQueries(
        each_row, torch.zeros_like(each_row), 1, _prefill_mask(last_visible, groups, hidden.dtype, shared)
    )
    rope = positions.unsqueeze(0)
    if vision is not None:
        hidden[0, vision.mask] = vision.embeds.to(hidden.dtype)
        rope = vision.rope_positions.unsqueeze(1)  # (3, 1, N)
    cos, sin = _rotary(model, hidden, rope)  # (1, N, D)
    cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # (N, 1, D)
    layers = inner.layers
    # The last layer computes the rows' last tokens only, unless an image's features are added after it.
    trims = TRIM_LAST_LAYER and (vision is None or len(vision.deepstack) < len(layers))
    trim_at = len(layers) - 1 if trims else len(layers)
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)[0]
        fused_layer = None if fused is None else fused[index]
        q, k, v = project_qkv(attn, x, fused_layer)
        q = q.view(total, heads, shape.head_dim)
        k = k.view(total, shape.kv_heads, shape.head_dim)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        v = v.view(total, shape.kv_heads, shape.head_dim)
        keys[index][slot_of, :, positions] = k
        values[index][slot_of, :, positions] = v
        queries = every_token
        if index == trim_at:
            queries, q, hidden = last_only, q.index_select(0, last), hidden.index_select(1, last)
        computed, width = q.shape[0], queries.width
        padded = q.new_zeros(rows, width, heads, shape.head_dim)
        padded[queries.row_of, queries.offset] = q
        # Grouped-query attention without repeating keys: a kv head's query heads act as its query rows.
        grouped = padded.permute(0, 2, 1, 3).reshape(rows, shape.kv_heads, groups * width, shape.head_dim)
        if shared is not None:
            out = shared.attend_prefill(
                grouped, keys[index], values[index], queries.mask, attn.scaling, slot_of_row
            )
        else:
            out = F.scaled_dot_product_attention(
                grouped,
                keys[index][:, :, :span].index_select(0, slot_of_row),
                values[index][:, :, :span].index_select(0, slot_of_row),
                attn_mask=queries.mask,
                scale=attn.scaling,
            )
        out = out.reshape(rows, heads, width, shape.head_dim).permute(0, 2, 1, 3)
        out = out[queries.row_of, queries.offset]
        hidden = hidden + attn.o_proj(out.reshape(1, computed, heads * shape.head_dim))
        hidden = hidden + mlp_output(layer.mlp, layer.post_attention_layernorm(hidden), fused_layer)
        if vision is not None and index < len(vision.deepstack):
            hidden[0, vision.mask] += vision.deepstack[index].to(hidden.dtype)
    last_tokens = hidden[0] if trim_at < len(layers) else hidden[0].index_select(0, last)
    return model.lm_head(inner.norm(last_tokens))


class _PrefillQueries(NamedTuple):
    """Which tokens a layer of `prefill_slots` computes queries for, laid out as its attention pads them: token
    i at (row_of[i], offset[i]) of (rows, width), and the additive mask of those query rows."""

    row_of: torch.Tensor
    offset: torch.Tensor
    width: int
    mask: torch.Tensor


def _prefill_mask(
    visible: torch.Tensor, groups: int, dtype: torch.dtype, shared: SharedPrefix | None
) -> torch.Tensor:
    """`prefill_slots`' additive mask of (rows, width, span) `visible`; over the positions past the shared
    prefix only where `shared` reads that prefix without one."""
    return _grouped_mask(visible if shared is None else visible[..., shared.length :], groups, dtype)


def extend_inputs(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    rope_offsets: torch.Tensor | None,
    span: int,
) -> tuple[torch.Tensor, ...]:
    """What every layer of `extend_step` reads: the embedded tokens (R, W, H), them through the first layer's
    input norm, the rotary cos and sin (R, 1, W, D) and the attention mask over `span` cache positions, one row
    of keys per query row of a kv head's group (R, 1, groups x W, span)."""
    inner = text_model(model)
    groups = text_config(model).num_attention_heads // KVShape.of(model).kv_heads
    hidden = inner.embed_tokens(token_ids)  # (R, W, H)
    rope = positions if rope_offsets is None else positions + rope_offsets.unsqueeze(1)
    cos, sin = _rotary(model, hidden, rope)  # (R, W, D)
    visible = torch.arange(span, device=token_ids.device).view(1, 1, span) <= positions.unsqueeze(2)
    x = inner.layers[0].input_layernorm(hidden)
    return hidden, x, cos.unsqueeze(1), sin.unsqueeze(1), _grouped_mask(visible, groups, hidden.dtype)


@torch.inference_mode()
def extend_step(
    model: torch.nn.Module,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    slot_ids: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    last: torch.Tensor,
    span: int,
    rope_offsets: torch.Tensor | None = None,
    regions: DecodeRegions | None = None,
    fused: list[LayerFused] | None = None,
) -> torch.Tensor:
    """Feed token_ids[r] (W tokens) at positions[r] of slot slot_ids[r]; write their keys and values; return the
    logits at token last[r] of each row (R, V). Attention reads cache positions 0..span-1, which must hold every
    real token's position.

    `decode_step` with W tokens per row instead of one, and fixed shapes, so a short prefill (an agent's next
    turn: an observation and the template around it) is one CUDA graph replay instead of an eager forward of
    hundreds of small kernels. Padding tokens (and padding rows) sit at the slot's last cache position, the
    sink no sequence reaches, so what they write is never read. `rope_offsets` (R,) long: as in `decode_step`.
    `regions`: the functions that run its parts (default: the plain `extend_inputs` and `slot_layer`;
    `compiled_extend_step` compiles them, the layer's parts around the cache only). `fused`: as `decode_step`'s.
    """
    regions = regions or PLAIN_EXTEND_REGIONS
    hidden, x, cos, sin, mask = regions.inputs(model, token_ids, positions, rope_offsets, span)
    _, x = through_layers(
        model, regions, keys, values, hidden, x, cos, sin, positions, mask, slot_ids, fused=fused
    )
    return model.lm_head(x[torch.arange(x.shape[0], device=x.device), last])


PLAIN_EXTEND_REGIONS = DecodeRegions(extend_inputs, slot_layer)
