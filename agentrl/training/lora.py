"""LoRA through peft: wrap the actor, and produce the weights the rollout engine serves.

Only adapter parameters are trained when `actor_rollout_ref.model.lora_rank > 0`. The reference policy is the
same model with its adapter disabled, so LoRA needs no second copy of the base weights. Each adapted linear
layer runs fused (`lora_fused.py`: thin or merged by its widths, in the input's dtype). The weights the engine
serves (adapters merged) come from `agentrl.training.parallel.served_weights`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from agentrl.training.lora_fused import fuse_lora_layers, is_fused

# `all-linear` on a vision-language model: the language model's linear layers only (not the vision tower).
_LANGUAGE_MODEL_LINEAR = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def apply_lora(
    model: torch.nn.Module,
    *,
    rank: int,
    alpha: int,
    target_modules: str | list[str],
    keep_merged: bool = True,
):
    """A peft model with fresh adapters of `rank` on `target_modules` ('all-linear' or module names).
    `keep_merged`: merged adapted layers keep their merged weight between calls (`lora_fused.py`); False for a
    model FSDP will shard.

    For a vision-language model `all-linear` means the language model's linear layers: the vision tower
    keeps its weights (and is frozen, as every non-adapter weight is under LoRA).
    """
    from peft import LoraConfig, get_peft_model

    if target_modules == "all-linear" and getattr(model.config, "vision_config", None) is not None:
        target_modules = _LANGUAGE_MODEL_LINEAR

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    fuse_lora_layers(model, keep_merged=keep_merged)
    return model


def is_lora_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run the base model (the reference policy) inside; a no-op for non-LoRA models."""
    with model.disable_adapter() if is_lora_model(model) else nullcontext():
        yield


def low_precision_base_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The base weights' dtype when float32 adapters (peft's default) sit on a bfloat16/float16 base and some
    adapted layer runs peft's own forward (not fused), else None.

    A sharded model under FSDP mixed precision casts every parameter, adapters included, to its compute dtype,
    and its parameters all share the master dtype here: None."""
    if not is_lora_model(model):
        return None
    if all(is_fused(m) for m in model.modules() if hasattr(m, "lora_A")):
        return None  # the fused layers compute in the input's dtype already
    base, adapters = set(), set()
    for name, param in model.named_parameters():
        (adapters if "lora_" in name else base).add(param.dtype)
    if adapters == {torch.float32} and len(base) == 1 and next(iter(base)) in (torch.bfloat16, torch.float16):
        return next(iter(base))
    return None


@contextmanager
def adapters_in_base_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Run float32 adapters on a bf16/fp16 base in the base's dtype: autocast, and peft's cast of every adapter
    layer's input to float32 turned off. The adapters keep float32 weights, gradients and optimizer state (the
    mixed precision FSDP gives a sharded model); without this each of a 0.5B model's 168 adapted layers copied
    its input to float32 and multiplied in float32, and a LoRA update took 1.6x a full fine-tuning update (H100,
    fourteenth session). `dtype`: `low_precision_base_dtype(model)`, found once by the caller (it walks every
    module and parameter: ~4 ms a call for a 0.5B LoRA model); None makes this a no-op."""
    if dtype is None:
        yield
        return
    from peft.helpers import disable_input_dtype_casting

    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=dtype), disable_input_dtype_casting(model):
        yield
