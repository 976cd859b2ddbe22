"""Saving and loading a trained model's state for checkpoints: whole (one process) or sharded (FSDP2).

One process writes the model (or its LoRA adapter) in Hugging Face format, so a checkpoint folder is also a
loadable model. Sharded workers write torch.distributed.checkpoint (DCP) shards of model and optimizer, each
rank its own part, and resume on the same world size; `save_full_weights` gathers one Hugging Face folder,
streamed to sharded safetensors so host memory holds one shard of it at a time.
"""

from __future__ import annotations

import json
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


EXPORT_SHARD_BYTES = 2 * 2**30
"""Largest safetensors file of a Hugging Face export (a bigger tensor gets a file of its own): what a gathering
export holds in host memory at once."""

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
    ".model-*.safetensors.part",
)


class _ShardWriter:
    """Weights written as they arrive, in Hugging Face's sharded safetensors layout: a shard is flushed before
    the tensor that would take it past `shard_bytes`, so only one shard waits in host memory. Shard files get
    their final names (`model-00001-of-00003.safetensors` + `model.safetensors.index.json`) once the count is
    known; weights that fit in one shard keep the single `model.safetensors`."""

    def __init__(self, folder: Path, shard_bytes: int) -> None:
        self.folder = folder
        self.shard_bytes = shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.total_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        for pattern in _WEIGHT_FILES:  # an earlier export's files would shadow or mix with this one's
            for stale in folder.glob(pattern):
                stale.unlink()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor.to("cpu").contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.folder / f".model-{len(self.shards) + 1:05d}.safetensors.part"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            self.shards[0][0].rename(self.folder / "model.safetensors")
            return
        weight_map = {}
        for index, (path, names) in enumerate(self.shards, start=1):
            name = f"model-{index:05d}-of-{len(self.shards):05d}.safetensors"
            path.rename(self.folder / name)
            weight_map.update(dict.fromkeys(names, name))
        index_file = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        text = json.dumps(index_file, indent=2, sort_keys=True) + "\n"
        (self.folder / "model.safetensors.index.json").write_text(text)


def save_full_weights(
    model: torch.nn.Module, tokenizer: Any, folder: Path, *, shard_bytes: int = EXPORT_SHARD_BYTES
) -> None:
    """One Hugging Face folder of the served weights (LoRA merged), gathered from shards one tensor at a time
    (a collective: every rank gathers, in the same order); rank 0 writes them in shards of `shard_bytes`."""
    from agentrl.training.parallel.served_weights import iter_served_weights

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    base = model.get_base_model() if is_lora_model(model) else model
    tied = getattr(base.config, "tie_word_embeddings", False)
    folder = Path(folder)
    writer = None
    if rank0:
        folder.mkdir(parents=True, exist_ok=True)
        writer = _ShardWriter(folder, shard_bytes)
    for name, tensor in iter_served_weights(model):
        if writer is not None and not (tied and name == "lm_head.weight"):
            writer.add(name, tensor)
    if writer is not None:
        writer.close()
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
