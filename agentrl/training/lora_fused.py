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
Only vanilla LoRA with one active adapter and no dropout takes this path; anything else (disabled or merged
adapters, dropout, DoRA, several adapters) runs peft's own forward.
"""

from __future__ import annotations

import types
from typing import Any

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
        y = F.linear(x, torch.addmm(weight, b, a), bias)
        _save(ctx, scaling, x, bias, lora_a, lora_b, x, weight, a, b)  # W' is formed again in backward
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, a, b = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        dy = dy.reshape(-1, dy.shape[-1])
        dx = dweight = dbias = da = db = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ torch.addmm(weight, b, a)).view(ctx.input_shape)
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


def _fused_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = None if args or kwargs else _fusable(self)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    return lora_linear(
        x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name]
    )


def fuse_lora_layers(model: torch.nn.Module) -> int:
    """Give every peft LoRA linear layer of `model` the fused forward (it falls back to peft's own whenever
    the layer is not plain LoRA at that call); returns how many layers it covers."""
    from peft.tuners.lora import Linear as LoRALinear

    count = 0
    for module in model.modules():
        if type(module) is LoRALinear:
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count


def is_fused(module: torch.nn.Module) -> bool:
    """Whether `module` runs the fused forward (`fuse_lora_layers` gave it one)."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is _fused_forward
