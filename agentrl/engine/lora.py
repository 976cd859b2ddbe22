"""LoRA through peft: wrap the actor, and produce the weights the rollout engine serves.

Only adapter parameters are trained when `actor_rollout_ref.model.lora_rank > 0`. The reference policy is the
same model with its adapter disabled, so LoRA needs no second copy of the base weights. The weights the
engine serves (adapters merged) come from `agentrl.engine.served_weights`.
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


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run the base model (the reference policy) inside; a no-op for non-LoRA models."""
    with model.disable_adapter() if is_lora_model(model) else nullcontext():
        yield
