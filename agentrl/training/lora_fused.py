"""A LoRA linear layer's forward and backward as an autograd function, in the input's dtype.

peft computes `base(x) + lora_B(lora_A(dropout(x))) * scaling`: with float32 adapters on a bf16 base it copies
every adapted layer's input to float32, and autograd adds a full-size multiply and add per layer forward and
again backward. Over a 0.5B model's 168 adapted layers that made a LoRA update 1.45x a full fine-tuning update
on an H100 (docs/benchmarks.md), where skipping the frozen weights' gradients should make it cheaper.

With W' = W + s B A (the adapters cast to the input's dtype; they keep float32 weights, gradients and optimizer
state), y = x W'^T + b, and backward computes only what is trained. Two ways to get the same numbers, each
cheaper at some widths (T tokens, `in` and `out` the layer's widths, r the rank):
- **thin**: y = x W^T + b + (x A^T)(s B)^T, the adapter product added in place (`addmm_`);
  g = dy (s B), dx = dy W + g A, dA = g^T x, dB = s dy^T (x A^T). The rank-r products are memory-bound passes
  over the activations, about T (5 in + 6 out) values forward, recomputed and backward.
- **merged**: W' is formed by one small GEMM (`addmm`, rounded once to the input's dtype, as the engine's
  merged copy is) and used as full fine-tuning uses its weight; backward forms dW' = dy^T x (full fine-tuning's
  weight gradient, 2 T in out FLOPs on the tensor cores) and reads the adapters' gradients from it:
  dA = (s B)^T dW', dB = s dW' A^T. Few, large kernels: the host keeps ahead of the device.
`merged_is_cheaper` picks per layer from that arithmetic: at a 0.5B model's widths merged (the thin passes cost
1.6-3x the weight gradient there, and their many small kernels leave the device waiting on the host), at 3B
and 7B shapes thin for the MLP and the square projections, merged for the narrow key and value projections.
Like full fine-tuning's bf16 compute from float32 weights, the merged forward sees an adapter change once it
moves W' by half a bf16 step; gradients reach A and B exactly.
A layer of a model that is not sharded *keeps* its merged weight (`fuse_lora_layers(keep_merged=True)`): W' is
formed once per change of W, A or B (an optimizer step, their version counters; all layers at once, in place),
by `_merge`'s formula (the one the engine is served under every path), so the sync sends that very tensor
(`kept_merged_weight`) and the trainer's forward runs on exactly the weights the engine sampled from. The
forward is then full fine-tuning's `F.linear` on a leaf W' (autograd's C++ backward forms dW' = dy^T x), and a
hook on W' turns each dW' into the adapters' gradients. Per optimizer step that is one merge per layer instead of one in every forward, recompute
and backward of every micro-batch, and no Python autograd function. A sharded model forms W' in each call
(`_MergedLoRALinear`): FSDP gathers A and B only inside the layer's forward and backward.
Only vanilla LoRA with one active adapter and no dropout takes this path; anything else (merged adapters,
dropout, DoRA, several adapters) runs peft's own forward, and disabled adapters (the reference policy) the base
layer alone.
"""

from __future__ import annotations

import functools
import types
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

# Device FLOPs a byte of memory traffic buys: where the thin passes' bytes take longer than the weight gradient's
# FLOPs, merged is cheaper. An H100's bf16 peaks (~990 TFLOP/s, 3.35 TB/s) give ~300, the rates reached ~240;
# 160 is what its update times drew (`benchmarks/update_step.py`: at the 0.5B shape merged 2% faster than thin,
# at the 3B shape thin 6% faster than merged), the small products' host time leaning against merged.
FLOPS_PER_BYTE = 160


def merged_is_cheaper(in_features: int, out_features: int) -> bool:
    """Whether forming W' (merged) costs less than the thin rank-r passes for a layer of these widths: the
    passes move ~T (5 in + 6 out) values of 2 bytes, the weight gradient merged adds is 2 T in out FLOPs."""
    return (5 * in_features + 6 * out_features) * FLOPS_PER_BYTE > in_features * out_features


def _adapters(lora_a, lora_b, scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A and s B in the compute dtype."""
    return lora_a.to(dtype), (lora_b * scaling).to(dtype)


def _merge(weight, a, scaled_b, out: torch.Tensor | None = None) -> torch.Tensor:
    """W' = W + (s B) A from the compute-dtype adapters (`_adapters`): the product accumulated and W added in the
    GEMM's float32, rounded once. Every merged weight is this: kept, formed per call, served."""
    return torch.addmm(weight.to(a.dtype), scaled_b, a, out=out)


def _save(ctx, scaling: float, x, bias, lora_a, lora_b, *tensors) -> None:
    ctx.save_for_backward(*tensors)
    ctx.scaling = scaling
    ctx.input_shape = x.shape
    ctx.lora_dtypes = (lora_a.dtype, lora_b.dtype)
    ctx.bias_dtype = None if bias is None else bias.dtype


class _ThinLoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        a, b = _adapters(lora_a, lora_b, scaling, x.dtype)
        flat = x.reshape(-1, x.shape[-1])
        h = flat @ a.t()
        y = F.linear(flat, weight, bias).addmm_(h, b.t())  # in place: `addmm` would first copy the output
        _save(ctx, scaling, x, bias, lora_a, lora_b, flat, h, weight, a, b)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        flat, h, weight, a, b = ctx.saved_tensors
        dy = dy.reshape(-1, dy.shape[-1])
        g = dy @ b
        dx = dweight = dbias = da = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ weight).addmm_(g, a).view(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            dweight = (dy.t() @ flat).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            dbias = dy.sum(0).to(ctx.bias_dtype)
        if ctx.needs_input_grad[3]:
            da = (g.t() @ flat).to(ctx.lora_dtypes[0])
        if ctx.needs_input_grad[4]:
            db = ((dy.t() @ h) * ctx.scaling).to(ctx.lora_dtypes[1])
        return dx, dweight, dbias, da, db, None


class _MergedLoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        a, b = _adapters(lora_a, lora_b, scaling, x.dtype)
        y = F.linear(x, _merge(weight, a, b), bias)
        _save(ctx, scaling, x, bias, lora_a, lora_b, x, weight, a, b)  # W' is formed again in backward
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, a, b = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        dy = dy.reshape(-1, dy.shape[-1])
        dx = dweight = dbias = da = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ _merge(weight, a, b)).view(ctx.input_shape)
        if any(ctx.needs_input_grad[i] for i in (1, 3, 4)):
            dmerged = dy.t() @ flat  # dL/dW', as full fine-tuning's weight gradient
            if ctx.needs_input_grad[1]:
                dweight = dmerged.to(weight.dtype)
            if ctx.needs_input_grad[3]:
                da = (b.t() @ dmerged).to(ctx.lora_dtypes[0])
            if ctx.needs_input_grad[4]:
                db = ((dmerged @ a.t()) * ctx.scaling).to(ctx.lora_dtypes[1])
        if ctx.needs_input_grad[2]:
            dbias = dy.sum(0).to(ctx.bias_dtype)
        return dx, dweight, dbias, da, db, None


def lora_linear(x, weight, bias, lora_a, lora_b, scaling: float, merged: bool | None = None) -> torch.Tensor:
    """x W^T + bias + scaling * (x A^T) B^T, computed in x's dtype; gradients in each parameter's dtype.
    `merged`: which way (module docstring); None picks by `merged_is_cheaper` for the layer's widths."""
    if merged is None:
        merged = merged_is_cheaper(weight.shape[1], weight.shape[0])
    function = _MergedLoRALinear if merged else _ThinLoRALinear
    return function.apply(x, weight, bias, lora_a, lora_b, scaling)


def _fusable(layer: Any) -> str | None:
    """The one adapter this peft layer can run fused, or None (peft's forward then runs)."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in getattr(layer, "lora_variant", {}):
        return None
    if not isinstance(layer.lora_dropout[name], torch.nn.Identity):
        return None
    if not isinstance(layer.base_layer, torch.nn.Linear) or getattr(layer, "fan_in_fan_out", False):
        return None
    return name


def merged_weight(weight, lora_a, lora_b, scaling: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """W + (s B) A in `dtype` (None: W's), A and s B rounded to it first (`_merge`): what the engine is served
    for a layer whose merged weight is not kept."""
    return _merge(weight, *_adapters(lora_a, lora_b, scaling, dtype or weight.dtype))


class _Kept(NamedTuple):
    """A layer's merged weight and what its gradient hook reads, valid while `key` holds."""

    key: tuple
    merged: torch.Tensor
    weight: torch.Tensor
    lora_a: torch.nn.Parameter
    lora_b: torch.nn.Parameter
    a: torch.Tensor
    """A in the merged weight's dtype."""
    scaled_b: torch.Tensor
    """s B in the merged weight's dtype."""
    scaling: float


def _adapter_gradients(layer: Any, merged: torch.Tensor) -> None:
    """W'.grad -> the adapters' gradients (dA = (s B)^T dW', dB = s dW' A^T, the products in dW''s dtype),
    added to theirs in their dtype; W'.grad is dropped. Runs each time autograd has accumulated into W' (once
    per backward): two products and two adds, from the compute-dtype adapters kept with W' (the hook ran on
    the host for ~110 us a layer when it cast them itself: 37 ms of a 0.5B LoRA update on an H200)."""
    grad, merged.grad = merged.grad, None
    kept: _Kept = layer.__dict__["_merged_weight"]
    if kept.lora_a.requires_grad:
        _accumulate(kept.lora_a, kept.scaled_b.t() @ grad)
    if kept.lora_b.requires_grad:
        _accumulate(kept.lora_b, grad @ kept.a.t(), kept.scaling)


def _accumulate(param: torch.nn.Parameter, update: torch.Tensor, scale: float = 1.0) -> None:
    if param.grad is None:
        param.grad = (update.mul_(scale) if scale != 1.0 else update).to(param.dtype)
    else:
        param.grad.add_(update, alpha=scale)


_optimizer_steps = [0]
"""Optimizer steps taken in this process: a fused optimizer writes parameters without bumping their version."""


@functools.cache
def _count_optimizer_steps() -> None:
    def counted(_optimizer, _args, _kwargs) -> None:
        _optimizer_steps[0] += 1

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(counted)


def _current(layer: Any, name: str, dtype: torch.dtype) -> tuple:
    """(key, W, A, B, s) of the layer now: the key changes after an optimizer step anywhere in the process, or
    an in-place write or new storage of W, A or B (their version counters, data pointers)."""
    weight, lora_a, lora_b = layer.base_layer.weight, layer.lora_A[name].weight, layer.lora_B[name].weight
    scaling = layer.scaling[name]
    versions = ((t.data_ptr(), t._version) for t in (weight, lora_a, lora_b))
    return (name, dtype, scaling, _optimizer_steps[0], *versions), weight, lora_a, lora_b, scaling


def _formed_in_place(kept: _Kept | None, weight, lora_a, lora_b) -> bool:
    """Whether `kept` can be formed again into its own tensors (same parameters, shape, trained or not)."""
    trains = lora_a.requires_grad or lora_b.requires_grad
    return (
        kept is not None
        and kept.weight is weight
        and kept.lora_a is lora_a
        and kept.lora_b is lora_b
        and (kept.merged.shape, kept.merged.requires_grad) == (weight.shape, trains)
    )


def _kept(layer: Any, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The layer's merged weight in `dtype`, formed again only when its key changed (`_current`). After an
    optimizer step every kept layer of the model is formed again at once (`_form_again_in_place`), into the
    same tensors, so an engine serving them (`served_weights.shared_serving_model`) and its CUDA graphs read
    the new weights where they read the old."""
    key, weight, lora_a, lora_b, scaling = _current(layer, name, dtype)
    kept: _Kept | None = layer.__dict__.get("_merged_weight")
    if kept is not None and kept.key == key:
        return kept.merged
    if kept is not None and kept.key[:2] == key[:2] and _formed_in_place(kept, weight, lora_a, lora_b):
        _form_again_in_place(layer.__dict__.get("_kept_peers", [layer]))
        return kept.merged
    layer.__dict__["_merged_weight"] = None  # the old one is freed before the new one is formed
    with torch.inference_mode(False), torch.no_grad():  # never an inference tensor: training reuses it
        a = lora_a.to(dtype, copy=True)  # its own copy: `_form_again_in_place` writes into it
        scaled_b = (lora_b * scaling).to(dtype)
        merged = _merge(weight, a, scaled_b)
        merged.requires_grad_(lora_a.requires_grad or lora_b.requires_grad)
    if merged.requires_grad:
        merged.register_post_accumulate_grad_hook(functools.partial(_adapter_gradients, layer))
    layer.__dict__["_merged_weight"] = _Kept(key, merged, weight, lora_a, lora_b, a, scaled_b, scaling)
    return merged


def _form_again_in_place(layers: list) -> None:
    """Form again every out-of-date kept merged weight of `layers` into its own tensors: the adapters' casts as
    three multi-tensor launches for all layers, then one `_merge` a layer. Formed a
    layer at a time this was ~6 kernels and ~125 us of host time a layer: 21 ms of each 0.5B LoRA sync (H200)."""
    stale = []
    for layer in layers:
        kept: _Kept | None = layer.__dict__.get("_merged_weight")
        if kept is None or kept.key[0] not in layer.lora_A:
            continue
        key, weight, lora_a, lora_b, scaling = _current(layer, kept.key[0], kept.key[1])
        if key != kept.key and _formed_in_place(kept, weight, lora_a, lora_b):
            stale.append((layer, kept._replace(key=key, scaling=scaling)))
    if not stale:
        return
    kept_now = [kept for _, kept in stale]
    with torch.inference_mode(False), torch.no_grad():
        torch._foreach_copy_([k.a for k in kept_now], [k.lora_a for k in kept_now])
        scaled = torch._foreach_mul([k.lora_b for k in kept_now], [k.scaling for k in kept_now])
        torch._foreach_copy_([k.scaled_b for k in kept_now], scaled)
        for k in kept_now:
            _merge(k.weight, k.a, k.scaled_b, out=k.merged)
    for layer, kept in stale:
        layer.__dict__["_merged_weight"] = kept


def _keeps_merged(layer: Any) -> bool:
    """Whether this fused layer runs merged and keeps W' (not sharded, frozen base)."""
    weight = layer.base_layer.weight
    return (
        layer.__dict__.get("_keeps_merged", False)
        and not weight.requires_grad
        and merged_is_cheaper(weight.shape[1], weight.shape[0])
    )


def kept_merged_weight(layer: Any, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """The merged weight this fused layer keeps, current, when it keeps one in `dtype` (None: the base
    weight's); else None (thin layers, sharded models, layers on peft's forward)."""
    name = _fusable(layer)
    dtype = dtype or layer.base_layer.weight.dtype
    if name is None or dtype != layer.base_layer.weight.dtype or not _keeps_merged(layer):
        return None
    return _kept(layer, name, dtype).detach()


def _fused_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if args or kwargs:
        return type(self).forward(self, x, *args, **kwargs)
    if self.disable_adapters and not self.merged:
        return self.base_layer(x)  # the reference policy: the base layer alone, without peft's checks
    name = _fusable(self)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    if _keeps_merged(self):
        return F.linear(x, _kept(self, name, x.dtype), base.bias)
    lora_a, lora_b, scaling = self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name]
    return lora_linear(x, base.weight, base.bias, lora_a, lora_b, scaling)


def fuse_lora_layers(model: torch.nn.Module, *, keep_merged: bool = True) -> int:
    """Give every peft LoRA linear layer of `model` the fused forward (it falls back to peft's own whenever
    the layer is not plain LoRA at that call); returns how many layers it covers. `keep_merged`: merged layers
    keep W' between calls (module docstring); False for a model FSDP will shard."""
    from peft.tuners.lora import Linear as LoRALinear

    _count_optimizer_steps()
    peers: list = []  # formed again together after an optimizer step
    for module in model.modules():
        if type(module) is LoRALinear:
            module.forward = types.MethodType(_fused_forward, module)
            module.__dict__["_keeps_merged"] = keep_merged
            module.__dict__.pop("_merged_weight", None)
            module.__dict__["_kept_peers"] = peers
            peers.append(module)
    return len(peers)


def is_fused(module: torch.nn.Module) -> bool:
    """Whether `module` runs the fused forward (`fuse_lora_layers` gave it one)."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is _fused_forward
