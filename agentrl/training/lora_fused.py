"""A LoRA linear layer's forward and backward as one autograd function, in the input's dtype.

peft computes `base(x) + lora_B(lora_A(dropout(x))) * scaling`: with float32 adapters on a bf16 base it copies
every adapted layer's input to float32, and autograd adds a full-size multiply and add per layer forward and
again backward. Over a 0.5B model's 168 adapted layers that made a LoRA update 1.45x a full fine-tuning update
on an H100 (docs/benchmarks.md), where skipping the frozen weights' gradients should make it cheaper.

Here y = x W^T + b + (x A^T)(s B)^T: the adapter product is added in place by the GEMM that computes it
(`addmm_`), the scaling sits on the small (out, r) matrix, the adapters are cast to the input's dtype (they
keep float32 weights, gradients and optimizer state), and backward computes only what is trained:
  g = dy (s B),  dx = dy W + g A,  dA = g^T x,  dB = s dy^T (x A^T)
(plus dW and db when the base layer itself is trainable). Only vanilla LoRA with one active adapter and no
dropout takes this path; anything else (disabled or merged adapters, dropout, DoRA, several adapters) runs
peft's own forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F


class _LoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        a = lora_a.to(x.dtype)
        b = (lora_b * scaling).to(x.dtype)
        flat = x.reshape(-1, x.shape[-1])
        h = flat @ a.t()
        y = F.linear(flat, weight, bias).addmm_(h, b.t())  # in place: `addmm` would first copy the output
        ctx.save_for_backward(flat, h, weight, a, b)
        ctx.scaling = scaling
        ctx.input_shape = x.shape
        ctx.lora_dtypes = (lora_a.dtype, lora_b.dtype)
        ctx.bias_dtype = None if bias is None else bias.dtype
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


def lora_linear(x, weight, bias, lora_a, lora_b, scaling: float) -> torch.Tensor:
    """x W^T + bias + scaling * (x A^T) B^T, computed in x's dtype; gradients in each parameter's dtype."""
    return _LoRALinear.apply(x, weight, bias, lora_a, lora_b, scaling)


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
