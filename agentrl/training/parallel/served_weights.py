"""The weights the rollout engine serves, streamed one tensor at a time from the trainer's model.

Names are those of the plain transformers model, so an engine loads them like any checkpoint. For a LoRA
model each adapted weight is merged out of place, W + scale * B @ A computed in float32 and rounded once to
the served dtype (a fused layer that keeps its merged weight for training hands over that very tensor): peft
keeps adapters in float32 over a bf16 base, and an in-place merge/unmerge round trip would leave rounding in the
frozen base (the reference policy). Under FSDP2 every tensor is gathered from
its shards as it is reached, so no rank ever holds the whole state dict at once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from agentrl.training.lora import is_lora_model
from agentrl.training.lora_fused import kept_merged_weight, merged_weight
from agentrl.training.parallel.fsdp import full_tensor

log = logging.getLogger(__name__)


def _active(module: torch.nn.Module) -> list[str]:
    return [a for a in module.active_adapters if a in module.lora_A]


def _merged_weight(module: torch.nn.Module, base: torch.Tensor) -> torch.Tensor:
    """W + s B A over the active adapters. One adapter (what the fused forward runs): `lora_fused.merged_weight`
    in the base's dtype, the tensor the trainer's forward forms from the same adapters (kept or, under FSDP,
    per call). Several, or fan-in-fan-out layers (peft's own forward): in float32, one `addmm` each."""
    adapters = _active(module)
    full = [(full_tensor(module.lora_A[a].weight), full_tensor(module.lora_B[a].weight), a) for a in adapters]
    if len(full) == 1 and not module.fan_in_fan_out:
        lora_a, lora_b, adapter = full[0]
        return merged_weight(base, lora_a.to(base.device), lora_b.to(base.device), module.scaling[adapter])
    merged = base.to(torch.float32, copy=True)  # never the base itself: the merge adds in place
    for lora_a, lora_b, adapter in full:
        a, b = lora_a.float().to(base.device), lora_b.float().to(base.device)
        if module.fan_in_fan_out:
            merged.addmm_(a.t(), b.t(), alpha=module.scaling[adapter])
        else:
            merged.addmm_(b, a, alpha=module.scaling[adapter])
    return merged


def _served_tensors(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.Tensor, Any]]:
    """(served name, tensor, the LoRA layer whose adapters merge into it or None) in `state_dict` order, tied
    weights under each name, without peft's adapter modules: a walk of the served modules only (a 0.5B model
    with LoRA on every linear layer has ~2,300 modules, ~500 of them served; its `state_dict()` was half a
    sync's host time)."""
    lora = _lora_layer_class()
    merging = isinstance(module, lora) and not module.merged and bool(_active(module))
    for name, param in module._parameters.items():
        if param is not None:
            yield prefix + name, param.detach(), None
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, buffer.detach(), None
    for name, child in module._modules.items():
        if child is None or (isinstance(module, lora) and name.startswith("lora_")):
            continue
        if isinstance(module, lora) and name == "base_layer":  # served under the layer's own name
            for key, tensor, _ in _served_tensors(child, prefix):
                yield key, tensor, module if merging and key == prefix + "weight" else None
        else:
            yield from _served_tensors(child, f"{prefix}{name}.")


def _lora_layer_class() -> type:
    from peft.tuners.lora import LoraLayer

    return LoraLayer


@torch.no_grad()
def iter_served_weights(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor in `dtype`, or the model's own dtype when None) for every served weight."""
    base = model.get_base_model() if is_lora_model(model) else model
    for name, value, layer in _served_tensors(base):
        tensor = full_tensor(value)
        own_dtype = tensor.dtype
        if layer is not None:
            kept = kept_merged_weight(layer, dtype)
            tensor = kept if kept is not None else _merged_weight(layer, tensor)
        yield name, tensor.to(dtype or own_dtype)


def shared_serving_model(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module | None:
    """A plain transformers model (no LoRA layers) whose every weight *is* a tensor `model` holds: its base
    weights, and each adapted layer's kept merged weight (`lora_fused.kept_merged_weight`, formed again in
    place after each optimizer step). The hybrid engine serves it as it serves a full fine-tuning actor: no
    second copy of the weights, nothing to copy at a sync. None where some served weight would be a new tensor
    (a thin or sharded adapted layer, another dtype): the engine then keeps a copy of its own."""
    base = model.get_base_model() if is_lora_model(model) else model
    served = dict(iter_served_weights(model, dtype))
    lora = _lora_layer_class()
    kept = (kept_merged_weight(m, dtype) for m in base.modules() if isinstance(m, lora) and _active(m))
    held = {t.data_ptr() for t in (*base.parameters(), *base.buffers(), *(k for k in kept if k is not None))}
    if any(t.data_ptr() not in held for t in served.values()):
        return None
    try:
        return _plain_model_over(base, served)
    except Exception as error:  # a model class that cannot be built this way serves a copy, as before
        log.warning(
            "the engine keeps its own copy of the weights: %s cannot serve the actor's tensors (%s: %s)",
            type(base).__name__,
            type(error).__name__,
            error,
        )
        return None


def _plain_model_over(base: torch.nn.Module, served: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`type(base)` built on the meta device, then given `served` (by assignment, no copy) and base's
    non-persistent buffers and tensor attributes (rotary frequencies); raises if any tensor stays on meta."""
    with torch.device("meta"):
        plain = type(base)(base.config)
    plain.load_state_dict(served, assign=True, strict=True)
    modules = {name.replace(".base_layer", ""): m for name, m in base.named_modules()}
    for name, module in plain.named_modules():
        for attr, value in list(vars(module).items()) + list(module._buffers.items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                source = getattr(modules[name], attr)
                if attr in module._buffers:
                    module._buffers[attr] = source
                else:
                    setattr(module, attr, source)
    left = [n for n, t in (*plain.named_parameters(), *plain.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"no tensor of the actor for {left[:3]}")
    plain.requires_grad_(False)
    if getattr(base, "generation_config", None) is not None:
        plain.generation_config = base.generation_config
    return plain.eval()


def served_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`iter_served_weights` as one dict (for tests and exports on one process)."""
    return dict(iter_served_weights(model, dtype))
