"""The weights the rollout engine serves, streamed one tensor at a time from the trainer's model.

Names are those of the plain transformers model, so an engine loads them like any checkpoint. For a LoRA
model each adapted weight is merged out of place, W + scale * B @ A computed in float32 and rounded once to
the served dtype (a fused layer that keeps its merged weight for training hands over that very tensor): peft
keeps adapters in float32 over a bf16 base, and an in-place merge/unmerge round trip would leave rounding in the
frozen base (the reference policy). Under FSDP2 every tensor is gathered from
its shards as it is reached, so no rank ever holds the whole state dict at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from agentrl.training.lora import is_lora_model
from agentrl.training.lora_fused import kept_merged_weight
from agentrl.training.parallel.fsdp import full_tensor


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and not module.merged and _active(module)
    }


def _active(module: torch.nn.Module) -> list[str]:
    return [a for a in module.active_adapters if a in module.lora_A]


def _merged_weight(module: torch.nn.Module, base: torch.Tensor) -> torch.Tensor:
    """W + sum of s B A over the active adapters, in float32 (one `addmm` each: no separate product, scale and add)."""
    merged = base.to(torch.float32, copy=True)  # never the base itself: the merge adds in place
    for adapter in _active(module):
        a = full_tensor(module.lora_A[adapter].weight).float().to(base.device)
        b = full_tensor(module.lora_B[adapter].weight).float().to(base.device)
        if module.fan_in_fan_out:
            merged.addmm_(a.t(), b.t(), alpha=module.scaling[adapter])
        else:
            merged.addmm_(b, a, alpha=module.scaling[adapter])
    return merged


@torch.no_grad()
def iter_served_weights(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor in `dtype`, or the model's own dtype when None) for every served weight."""
    lora = is_lora_model(model)
    base = model.get_base_model() if lora else model
    layers = _lora_layers(base) if lora else {}
    for key, value in base.state_dict().items():
        if lora and "lora_" in key:
            continue
        tensor = full_tensor(value)
        own_dtype = tensor.dtype
        prefix, _, leaf = key.rpartition(".base_layer.")
        if prefix in layers and leaf == "weight":
            kept = kept_merged_weight(layers[prefix], dtype)
            tensor = kept if kept is not None else _merged_weight(layers[prefix], tensor)
        yield key.replace(".base_layer.", "."), tensor.to(dtype or own_dtype)


def served_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`iter_served_weights` as one dict (for tests and exports on one process)."""
    return dict(iter_served_weights(model, dtype))
