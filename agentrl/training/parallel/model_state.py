"""Saving and loading a trained model's state for checkpoints: whole (one process) or sharded (FSDP2).

One process writes the model (or its LoRA adapter) in Hugging Face format, so a checkpoint folder is also a
loadable model. Sharded workers write torch.distributed.checkpoint (DCP) shards of model and optimizer, each
rank its own part, and resume on the same world size; `save_full_weights` gathers one Hugging Face folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.training.lora import is_lora_model
from agentrl.training.parallel.fsdp import is_sharded


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its shards of model and optimizer state under `folder` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not Path(folder).is_dir():
        raise FileNotFoundError(
            f"{folder}: no sharded checkpoint here; a checkpoint written by trainer.backend=local resumes "
            f"only with trainer.backend=local"
        )
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def save_whole(model: torch.nn.Module, folder: Path) -> None:
    """Model (or adapter) in Hugging Face format, from one process."""
    model.save_pretrained(folder)


def load_whole(model: torch.nn.Module, folder: Path) -> None:
    from safetensors.torch import load_file

    if is_lora_model(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(Path(folder) / "adapter_model.safetensors"))
        return
    missing, unexpected = model.load_state_dict(load_file(Path(folder) / "model.safetensors"), strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"checkpoint {folder} does not fit the model: missing {missing}, unexpected {unexpected}"
        )


def save_frozen(model: torch.nn.Module, folder: Path) -> None:
    """A model without an optimizer (the reference policy): HF format from one process, DCP shards under FSDP2."""
    if not is_sharded(model):
        save_whole(model, Path(folder))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(folder))


def load_frozen(model: torch.nn.Module, folder: Path) -> None:
    """Load what `save_frozen` wrote."""
    if not is_sharded(model):
        load_whole(model, Path(folder))
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"])


def save_full_weights(model: torch.nn.Module, tokenizer: Any, folder: Path) -> None:
    """One Hugging Face folder of the served weights (LoRA merged), gathered from shards; rank 0 writes it."""
    from safetensors.torch import save_file

    from agentrl.training.parallel.served_weights import iter_served_weights

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    base = model.get_base_model() if is_lora_model(model) else model
    tied = getattr(base.config, "tie_word_embeddings", False)
    state = {}
    for name, tensor in iter_served_weights(model):
        if rank0 and not (tied and name == "lm_head.weight"):
            state[name] = tensor.to("cpu").contiguous()
    if rank0:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        base.config.save_pretrained(folder)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
    if dist.is_initialized():
        dist.barrier()


def save_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, name: str) -> None:
    """`folder/name` in HF format (one process) or `folder/name_dcp` shards (FSDP2)."""
    if is_sharded(model):
        save_sharded(model, optimizer, Path(folder) / f"{name}_dcp")
    else:
        save_whole(model, Path(folder) / name)


def load_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path, name: str) -> bool:
    """Load what `save_model` wrote; returns True when the optimizer state came with it (sharded)."""
    if is_sharded(model):
        load_sharded(model, optimizer, Path(folder) / f"{name}_dcp")
        return True
    if not (Path(folder) / name).is_dir():
        raise FileNotFoundError(
            f"{Path(folder) / name}: no whole-model checkpoint here; a checkpoint written by trainer.backend=ray "
            f"resumes only with trainer.backend=ray on the same number of devices"
        )
    load_whole(model, Path(folder) / name)
    return False
