"""The weights the rollout engine serves, streamed one tensor at a time from the trainer's model.

Names are those of the plain transformers model, so an engine loads them like any checkpoint. For a LoRA
model each adapted weight is merged out of place, W + scale * B @ A computed in float32 and rounded once to
the served dtype: peft keeps adapters in float32 over a bf16 base, and an in-place merge/unmerge round trip
would leave rounding in the frozen base (the reference policy). Under FSDP2 every tensor is gathered from
its shards as it is reached, so no rank ever holds the whole state dict at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from agentrl.training.lora import is_lora_model
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
    delta = torch.zeros(base.shape, dtype=torch.float32, device=base.device)
    for adapter in _active(module):
        a = full_tensor(module.lora_A[adapter].weight).float()
        b = full_tensor(module.lora_B[adapter].weight).float()
        update = (b @ a).to(base.device)
        delta += (update.T if module.fan_in_fan_out else update) * module.scaling[adapter]
    return base.float() + delta


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
            tensor = _merged_weight(layers[prefix], tensor)
        yield key.replace(".base_layer.", "."), tensor.to(dtype or own_dtype)


def served_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`iter_served_weights` as one dict (for tests and exports on one process)."""
    return dict(iter_served_weights(model, dtype))
