"""Weight updates for a served transformers model: in-place loads, fingerprints, merged LoRA adapters.

The hybrid engine syncs weights every training step, so the trainer must be able to check that the
engine serves exactly what it trained: `fingerprint_state_dict` hashes a strided sample of every
tensor's values (as float64, so a bf16 copy and its fp32 upcast agree). It is exact and reads only
a few thousand numbers per tensor, so it stays cheap for large models; a change confined to the
unsampled elements of a tensor goes unseen (full updates and LoRA merges touch every element).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

_SAMPLES_PER_TENSOR = 1024


@functools.lru_cache(maxsize=1024)
def _sample_indices(numel: int, device: torch.device) -> torch.Tensor:
    """Where a tensor of `numel` elements is sampled, made once per size and device. Integer arithmetic: a
    float32 `linspace` rounds past the end for tensors over 2^24 elements (a 0.5B model's embedding has 136M)
    and then indexes out of bounds."""
    steps = torch.arange(_SAMPLES_PER_TENSOR, dtype=torch.int64, device=device)
    return steps * (numel - 1) // (_SAMPLES_PER_TENSOR - 1)


def _device_sample(tensor: torch.Tensor) -> torch.Tensor:
    """A strided sample of `tensor`'s values as a float64 copy on its own device (no host round trip)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() > _SAMPLES_PER_TENSOR:
        flat = flat.index_select(0, _sample_indices(flat.numel(), flat.device))
    return flat.to(torch.float64, copy=True)


class Fingerprint:
    """Builds `fingerprint_state_dict` one tensor at a time, in any order (for weights that stream in).

    Samples stay on their device until `hexdigest`, which brings them to the host in one copy per device: a
    copy per tensor waited for the device each time (two per tensor and sync, ~290 tensors for a 0.5B model)."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[bytes, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self._parts[name] = (f"{name}:{tuple(tensor.shape)}:".encode(), _device_sample(tensor))

    def hexdigest(self) -> str:
        names = sorted(self._parts)
        by_device: dict[torch.device, list[str]] = {}
        for name in names:
            by_device.setdefault(self._parts[name][1].device, []).append(name)
        values: dict[str, bytes] = {}
        for group in by_device.values():
            samples = [self._parts[name][1] for name in group]
            host = torch.cat(samples).cpu().numpy()
            offset = 0
            for name, sample in zip(group, samples, strict=True):
                values[name] = host[offset : offset + sample.numel()].tobytes()
                offset += sample.numel()
        digest = hashlib.sha256()
        for name in names:
            digest.update(self._parts[name][0] + values[name])
        return digest.hexdigest()[:32]


def fingerprint_state_dict(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Hash of names, shapes and a strided value sample of every tensor; equal weights -> equal string."""
    fingerprint = Fingerprint()
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor):
            fingerprint.add(name, tensor)
    return fingerprint.hexdigest()


def _check_tensor(own: Mapping[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    if name not in own:
        raise ValueError(f"update_weights: unknown parameter name {name!r} (model has e.g. {list(own)[:3]})")
    if tuple(value.shape) != tuple(own[name].shape):
        raise ValueError(
            f"update_weights: {name} has shape {tuple(value.shape)}, model expects {tuple(own[name].shape)}"
        )


@torch.no_grad()
def load_weights_in_place(
    model: torch.nn.Module, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy weights into the model's own tensors (same storage, so nothing is reallocated).

    Names must be the model's own (`model.state_dict()` keys); missing names keep their values, so a
    partial update (e.g. without a tied `lm_head.weight`) is allowed. A mapping is checked whole before
    anything is written (unknown names or wrong shapes raise ValueError naming the tensor); a stream of
    (name, tensor) pairs, which the trainer sends so that no full state dict is ever built, is checked tensor
    by tensor, and the fingerprint check after the sync catches an update that stopped half way.
    """
    own = model.state_dict()
    if isinstance(weights, Mapping):
        for name, value in weights.items():
            _check_tensor(own, name, value)
        weights = weights.items()
    for name, value in weights:
        _check_tensor(own, name, value)
        own[name].copy_(value)


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Read a `.safetensors` file, or every `*.safetensors` file of an HF model folder.

    A file that is not safetensors is a ValueError naming it (safetensors' own error is no ValueError)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    source = Path(path)
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors")) if source.is_dir() else []
    if not files:
        raise ValueError(
            f"update_weights: {path!r} is neither a .safetensors file nor a folder containing one"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except SafetensorError as error:
            raise ValueError(
                f"update_weights: {str(file)!r} is not a readable .safetensors file ({error})"
            ) from None
    return state


class LoraMerger:
    """Merges one peft LoRA adapter at a time into the served weights, restoring the base first.

    Merging (rather than serving through peft's wrapped modules) keeps the decode path identical
    for base and adapter and costs nothing per token. The price: one adapter is active at a time,
    and the original values of the touched weights are kept (on CPU) to undo the merge when the
    next adapter arrives.
    """

    def __init__(self) -> None:
        self._originals: dict[str, torch.Tensor] = {}
        self.active: str | None = None

    def forget_base(self) -> None:
        """A full weight update replaced the base: the next adapter merges onto the new weights."""
        self._originals.clear()
        self.active = None

    @torch.no_grad()
    def restore_base(self, model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())
        for name, original in self._originals.items():
            params[name].copy_(original)
        self._originals.clear()
        self.active = None

    @torch.no_grad()
    def merge(self, model: torch.nn.Module, name: str, path: str) -> None:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer

        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"load_lora_adapter: no adapter_config.json in lora_path {path!r}")
        self.restore_base(model)
        id_to_name = {id(p): n for n, p in model.named_parameters()}
        peft_model = PeftModel.from_pretrained(model, path, adapter_name="default", is_trainable=False)
        originals: dict[str, torch.Tensor] = {}
        for module in peft_model.modules():
            if isinstance(module, LoraLayer):
                for param in module.get_base_layer().parameters(recurse=False):
                    if id(param) in id_to_name:
                        originals[id_to_name[id(param)]] = param.detach().to("cpu", copy=True)
        peft_model.merge_and_unload()
        for attr in ("peft_config", "_hf_peft_config_loaded"):
            if hasattr(model, attr) and attr in model.__dict__:
                delattr(model, attr)
        self._originals = originals
        self.active = name
