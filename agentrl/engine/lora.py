"""LoRA through peft: wrap the actor, and produce the weights the rollout engine serves.

Only adapter parameters are trained when `actor_rollout_ref.model.lora_rank > 0`. The reference policy is the
same model with its adapter disabled, so LoRA needs no second copy of the base weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch


def apply_lora(model: torch.nn.Module, *, rank: int, alpha: int, target_modules: str | list[str]):
    """A peft model with fresh adapters of `rank` on `target_modules` ('all-linear' or module names)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def is_lora_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def served_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights the engine should serve: for a LoRA model, the base with adapters merged in.

    Keys are those of the plain transformers model, so the engine loads them like any checkpoint. The merge
    is computed out of place (W + delta per adapted layer): peft's merge_adapter/unmerge_adapter round trip
    would add and subtract the delta in place, leaving float rounding in the frozen base (the reference policy)
    after every sync.
    """
    if not is_lora_model(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged = {
        key.replace(".base_layer.", "."): value.detach()
        for key, value in base.state_dict().items()
        if "lora_" not in key
    }
    with torch.no_grad():
        for name, module in base.named_modules():
            if not isinstance(module, LoraLayer) or module.merged:
                continue
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            if adapters:
                weight = module.get_base_layer().weight
                merged[f"{name}.weight"] = weight + sum(module.get_delta_weight(a) for a in adapters)
    return merged


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run the base model (the reference policy) inside; a no-op for non-LoRA models."""
    with model.disable_adapter() if is_lora_model(model) else nullcontext():
        yield
