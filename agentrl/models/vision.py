"""Processor files for the tiny Qwen-VL presets, and a Qwen-VL processor that needs no torchvision.

The processor config is written as plain JSON with the standard Qwen2-VL image processor keys (both the
`min_pixels`/`max_pixels` spelling of transformers 4 and the `size` dict of transformers 5), which
Qwen3-VL uses too, so `AutoProcessor.from_pretrained(folder)` works in either version and in vLLM.
Pixel bounds are small so an image becomes a handful of tokens on CPU.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.models.tiny import TinyPreset

# Per tiny-preset family: processor class, video processor class, and the image normalisation of the real
# checkpoints (CLIP's for Qwen2-VL, 0.5 for Qwen3-VL).
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_PROCESSOR_FILES = {
    "qwen2-vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor", _CLIP_MEAN, _CLIP_STD),
    "qwen3-vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor", [0.5] * 3, [0.5] * 3),
}
# model_type -> processor class, for the image-only processor (`build_image_only_processor`).
_PROCESSOR_CLASSES = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
}


def build_image_processor_config(preset: TinyPreset) -> dict[str, Any]:
    vision, bounds = preset.vision or {}, preset.image_processor or {}
    processor_class, _, mean, std = _PROCESSOR_FILES[preset.family]
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
        "min_pixels": bounds["min_pixels"],
        "max_pixels": bounds["max_pixels"],
        "size": {"shortest_edge": bounds["min_pixels"], "longest_edge": bounds["max_pixels"]},
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "image_mean": mean,
        "image_std": std,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
    }


def save_processor_files(folder: str | Path, preset: TinyPreset) -> None:
    """Write preprocessor_config.json (+ video config, processor_config.json) next to the tokenizer."""
    folder = Path(folder)
    image_config = build_image_processor_config(preset)
    (folder / "preprocessor_config.json").write_text(json.dumps(image_config, indent=1))
    processor_class, video_class, _, _ = _PROCESSOR_FILES[preset.family]
    video_config = {**image_config, "video_processor_type": video_class}
    del video_config["image_processor_type"]
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video_config, indent=1))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}, indent=1))


def has_image_only_processor(model_type: str | None) -> bool:
    """Whether `build_image_only_processor` knows this model type's processor."""
    return model_type in _PROCESSOR_CLASSES


@functools.cache
def _image_only_processor_class(model_type: str):
    """The model type's processor class minus its video processor (defined on first use, so importing this
    module never imports transformers). The `__init__` signature names the processor's parts for
    transformers (`ProcessorMixin.get_attributes`), so leaving `video_processor` out drops that part; the
    parent's `__init__` still sets the image/video token attributes."""
    import transformers

    parent = getattr(transformers, _PROCESSOR_CLASSES[model_type])

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        parent.__init__(self, image_processor, tokenizer, None, chat_template=chat_template)

    return type(f"ImageOnly{parent.__name__}", (parent,), {"__init__": __init__})


def build_image_only_processor(folder: str | Path, model_type: str):
    """A Qwen-VL processor (`model_type` qwen2_vl, qwen2_5_vl or qwen3_vl) without its video half, for
    machines without torchvision.

    transformers 5 refuses to build these processors when the video processor cannot load, and that one
    needs torchvision, which has no CPU build here. Images only need the PIL image processor, so this
    builds the same processor class minus the video attribute; it renders and tokenizes exactly like the
    full one for text and images (videos are not supported).
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder)
    processor_cls = _image_only_processor_class(model_type)
    return processor_cls(image_processor, tokenizer, chat_template=tokenizer.chat_template)


def is_vision_language_model(model: Any) -> bool:
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def apply_vision_tower_setting(model: Any, model_config: Any) -> None:
    """Freeze a vision-language policy's vision tower when `actor_rollout_ref.model.freeze_vision_tower`
    says so (null: frozen with LoRA, trained in full fine-tuning); text models are left alone."""
    if not is_vision_language_model(model):
        return
    freeze = model_config.freeze_vision_tower
    if freeze is None:
        freeze = model_config.lora_rank > 0
    if freeze:
        model.model.visual.requires_grad_(False)
