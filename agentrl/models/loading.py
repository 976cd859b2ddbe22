"""Loading models, tokenizers and processors through the ordinary transformers path.

Every path first goes through `resolve_model_path`, so `tiny:` specs, the `smollm2-135m-instruct`
preset, local folders and hub ids are all loaded the same way (`from_pretrained` on a folder); nothing
here is preset-specific.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from agentrl.models.smollm2 import SMOLLM2_NAME, smollm2_problem
from agentrl.models.tiny import TINY_PREFIX, resolve_model_path

# A Hugging Face repo id: `name` or `namespace/name`, word characters, '.' and '-', at most 96 long.
_HUB_ID_RE = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")

_DTYPES = ("float32", "bfloat16", "float16")


def _to_torch_dtype(dtype: str):
    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {list(_DTYPES)}")
    return getattr(torch, dtype)


def model_path_problem(path: str, key: str) -> str | None:
    """Why `path` (the value of config key `key`) cannot name a model, or None when it can.

    A `tiny:` preset, an existing folder and anything shaped like a hub id (`org/name`) pass; a
    path that does not exist and cannot be a hub id (absolute, `./`, `~`, several slashes) fails
    here with the key named, instead of later with transformers' "Repo id must be in the form".
    `smollm2-135m-instruct` passes once converted or where its wheel and `gguf` are installed.
    """
    if path == SMOLLM2_NAME:
        return smollm2_problem(key)
    if path.startswith(TINY_PREFIX) or Path(path).expanduser().exists():
        return None
    if _HUB_ID_RE.match(path) and ".." not in path and "--" not in path:
        return None
    return (
        f"{key}={path!r}: no such file or folder, and not a Hugging Face model id "
        "(such as 'Qwen/Qwen2.5-0.5B-Instruct'); give an existing model folder, a hub id, tiny:<preset> "
        f"or {SMOLLM2_NAME}"
    )


def _check_path(path: str) -> None:
    problem = model_path_problem(path, "model path")
    if problem is not None:
        raise FileNotFoundError(problem)


def load_tokenizer(path: str, **kwargs: Any):
    """`AutoTokenizer.from_pretrained` on the resolved path (fast tokenizer, with its chat template)."""
    from transformers import AutoTokenizer

    _check_path(path)
    return AutoTokenizer.from_pretrained(resolve_model_path(path), **kwargs)


def _is_vision_language(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_causal_lm(path: str, dtype: str = "float32", device: str = "cpu", **kwargs: Any):
    """Load a causal LM (or, for a vision-language folder, the image-text-to-text model) in eval mode.

    Callers that train switch it to `.train()`; keeping eval as the default means a freshly loaded
    model generates deterministically (no dropout) wherever it is used. Weights load straight onto
    `device` (`device_map`, accelerate's big-model loading), not through a full copy in host memory.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    _check_path(path)
    resolved = resolve_model_path(path)
    config = AutoConfig.from_pretrained(resolved, trust_remote_code=kwargs.get("trust_remote_code", False))
    auto_cls = AutoModelForImageTextToText if _is_vision_language(config) else AutoModelForCausalLM
    kwargs.setdefault("device_map", device)
    model = auto_cls.from_pretrained(resolved, dtype=_to_torch_dtype(dtype), **kwargs)
    return model.to(device).eval()


def load_processor(path: str, **kwargs: Any):
    """`AutoProcessor.from_pretrained` on the resolved path (image processor + tokenizer for VL models).

    Where the video processor cannot load (no torchvision, as on CPU-only machines) a Qwen2-VL, Qwen2.5-VL
    or Qwen3-VL folder gets the same processor without its video half (`vision.build_image_only_processor`).
    """
    from transformers import AutoConfig, AutoProcessor

    _check_path(path)
    resolved = resolve_model_path(path)
    try:
        return AutoProcessor.from_pretrained(resolved, **kwargs)
    except ImportError as exc:
        from agentrl.models.vision import build_image_only_processor, has_image_only_processor

        model_type = getattr(AutoConfig.from_pretrained(resolved), "model_type", None)
        if "torchvision" not in str(exc).lower() or not has_image_only_processor(model_type):
            raise
        return build_image_only_processor(resolved, model_type)
