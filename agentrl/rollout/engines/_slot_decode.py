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
Others (sliding windows, multimodal rotary positions, dynamic RoPE) use the `DynamicCache` path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SLOT_DECODE_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")
_STATIC_ROPE_TYPES = (None, "default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class KVShape:
    """What one token of one sequence occupies in the cache, per layer."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model: torch.nn.Module) -> KVShape:
        cfg = model.config
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
    cfg = model.config
    if any(kind != "full_attention" for kind in getattr(cfg, "layer_types", None) or ()):
        return "some layers use sliding-window attention"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "the model uses sliding-window attention"
    rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type not in _STATIC_ROPE_TYPES or (isinstance(rope, dict) and "mrope_section" in rope):
        return f"rope type {rope_type!r} is not position-independent"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, attr) for attr in needed):
        return f"{name} lacks model.{{{', '.join(needed)}}}"
    return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, heads, 1, D): x*cos + rotate_half(x)*sin, rotate_half = (-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _heads(projected: torch.Tensor, head_dim: int, norm: torch.nn.Module | None) -> torch.Tensor:
    """(B, 1, heads*D) -> (B, heads, 1, D), with the per-head norm of Qwen3-style attention."""
    states = projected.view(projected.shape[0], 1, -1, head_dim)
    if norm is not None:
        states = norm(states)
    return states.transpose(1, 2)


@torch.inference_mode()
def decode_step(
    model: torch.nn.Module,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    token_ids: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Feed token_ids[i] at positions[i] of slot i (i < b); write its keys and values; return logits (b, V).

    keys[l] / values[l]: (slots, kv_heads, length, D); slot i attends to its positions 0..positions[i].
    """
    inner = model.model
    batch = token_ids.shape[0]
    shape = KVShape.of(model)
    hidden = inner.embed_tokens(token_ids.unsqueeze(1))  # (b, 1, H)
    cos, sin = inner.rotary_emb(hidden, positions.unsqueeze(1))  # (b, 1, D)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    slots = torch.arange(batch, device=token_ids.device)
    length = keys[0].shape[2]
    visible = (torch.arange(length, device=token_ids.device).unsqueeze(0) <= positions.unsqueeze(1)).view(
        batch, 1, 1, length
    )
    for index, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = _rotate(_heads(attn.q_proj(x), shape.head_dim, getattr(attn, "q_norm", None)), cos, sin)
        k = _rotate(_heads(attn.k_proj(x), shape.head_dim, getattr(attn, "k_norm", None)), cos, sin)
        v = _heads(attn.v_proj(x), shape.head_dim, None)
        keys[index][slots, :, positions] = k[:, :, 0]
        values[index][slots, :, positions] = v[:, :, 0]
        # Grouped-query attention without repeating keys: a kv head's query heads act as its query rows.
        grouped = q.reshape(batch, shape.kv_heads, -1, shape.head_dim)
        out = F.scaled_dot_product_attention(
            grouped, keys[index][:batch], values[index][:batch], attn_mask=visible, scale=attn.scaling
        )
        hidden = hidden + attn.o_proj(out.reshape(batch, 1, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden))[:, 0]
