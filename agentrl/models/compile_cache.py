"""torch.compile's caches kept across runs, in agentrl's cache folder, one folder per model and toolchain.

A fresh process compiles the engine's decode step (and the update's logit math) before its first step: a
minute or more on a GPU host, every run. Inductor can reuse compiled graphs and Triton kernels from an
earlier process when it finds them in its cache folders; by default those live under the system's temporary
folder, which cluster jobs and containers start empty. `use_compile_cache` points them at
`$AGENTRL_CACHE/compile/<key>` (the folder the tiny presets use), where the key hashes what a compiled
artifact depends on: torch and Triton versions, the device, the model's architecture and dtype. A changed
model shape, dtype, torch or GPU gets a new folder, so nothing stale is ever offered; Inductor's own cache
keys (the graph, its guards) decide the rest. A user who set `TORCHINDUCTOR_CACHE_DIR` keeps their folder.

Python's own bytecode is the other cache a start-up leans on: an image that ships torch without `.pyc` files
and sets `PYTHONDONTWRITEBYTECODE` compiles torch's source again in every process (5-11 s of each start on
an H100 host, docs/benchmarks.md); `uncached_bytecode_warning` says so, with the one command that fixes it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from agentrl.models.cache import cache_base

logger = logging.getLogger(__name__)

_CONFIG_KEYS_IGNORED = ("_name_or_path", "transformers_version", "_commit_hash", "torch_dtype", "dtype")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    return device.type


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"


def compile_cache_key(model_config: Any, dtype: torch.dtype, device: torch.device) -> str:
    """16 hex digits over everything a compiled artifact of this model depends on (not its weights)."""
    config = model_config.to_dict() if hasattr(model_config, "to_dict") else dict(model_config)
    for key in _CONFIG_KEYS_IGNORED:
        config.pop(key, None)
    described = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "device": _device_name(device),
        "dtype": str(dtype),
        "model": config,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _chosen_by_user() -> bool:
    """Whether `TORCHINDUCTOR_CACHE_DIR` names a folder other than ours and Inductor's default (importing
    torch._dynamo sets it to the default)."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or current == os.environ.get("AGENTRL_COMPILE_CACHE_DIR"):
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(current) != os.path.abspath(default_cache_dir())


def compile_cache_dir(model_config: Any, dtype: torch.dtype, device: torch.device) -> Path:
    return cache_base() / "compile" / compile_cache_key(model_config, dtype, device)


def use_compile_cache(model_config: Any, dtype: torch.dtype, device: torch.device) -> Path | None:
    """Point Inductor's and Triton's caches at this model's folder (before anything compiles); returns it,
    or None when the user chose their own folder with `TORCHINDUCTOR_CACHE_DIR`."""
    if _chosen_by_user():
        return None
    folder = compile_cache_dir(model_config, dtype, device)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    os.environ["AGENTRL_COMPILE_CACHE_DIR"] = str(folder)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    logger.info("torch.compile caches in %s", folder)
    return folder


def uncached_bytecode_warning(module_file: str | None = None, dont_write: bool | None = None) -> str | None:
    """A warning when Python has no bytecode for torch and will not write it, so every process compiles
    torch's source again; None when the bytecode is there or this process writes it.

    `module_file` (one of torch's largest modules by default) and `dont_write` (`sys.dont_write_bytecode`)
    are parameters so that the check can be tried on a file of one's own."""
    if module_file is None:
        import torch._tensor

        module_file = torch._tensor.__file__
        packages = Path(torch.__file__).parent.parent  # the site-packages folder that holds torch
    else:
        packages = Path(module_file).parent
    dont_write = sys.dont_write_bytecode if dont_write is None else dont_write
    cached = Path(importlib.util.cache_from_source(module_file))
    if cached.exists():
        return None
    writable = os.access(cached.parent if cached.parent.exists() else Path(module_file).parent, os.W_OK)
    if not dont_write and writable:
        return None  # this process writes it and the next one reads it
    why = "PYTHONDONTWRITEBYTECODE is set" if dont_write else f"{cached.parent} is not writable"
    return (
        f"Python has no bytecode for {module_file} and {why}: every process compiles torch's source again "
        f"(5-11 s of each start on a GPU host). Compile it once: python -m compileall -q -j 0 {packages}"
    )
