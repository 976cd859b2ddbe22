"""Processor files for the tiny Qwen2-VL preset, and a Qwen2-VL processor that needs no torchvision.

The processor config is written as plain JSON with the standard Qwen2-VL keys (both the
`min_pixels`/`max_pixels` spelling of transformers 4 and the `size` dict of transformers 5), so
`AutoProcessor.from_pretrained(folder)` works in either version and in vLLM. Pixel bounds are
small so an image becomes a handful of tokens on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.models.tiny import TinyPreset

# CLIP normalisation, which Qwen2-VL uses.
_IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
_IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


def build_image_processor_config(preset: TinyPreset) -> dict[str, Any]:
    vision, bounds = preset.vision or {}, preset.image_processor or {}
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "min_pixels": bounds["min_pixels"],
        "max_pixels": bounds["max_pixels"],
        "size": {"shortest_edge": bounds["min_pixels"], "longest_edge": bounds["max_pixels"]},
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "image_mean": _IMAGE_MEAN,
        "image_std": _IMAGE_STD,
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
    video_config = {**image_config, "video_processor_type": "Qwen2VLVideoProcessor"}
    del video_config["image_processor_type"]
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video_config, indent=1))
    (folder / "processor_config.json").write_text(
        json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=1)
    )


def _image_only_processor_class():
    """Define the class on first use so importing this module never imports transformers."""
    global _ImageOnlyProcessor
    if _ImageOnlyProcessor is None:
        from transformers import Qwen2VLProcessor
        from transformers.processing_utils import ProcessorMixin

        class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
            def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
                self.image_token = "<|image_pad|>"
                self.video_token = "<|video_pad|>"
                self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
                self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
                ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        _ImageOnlyProcessor = ImageOnlyQwen2VLProcessor
    return _ImageOnlyProcessor


_ImageOnlyProcessor = None


def build_image_only_processor(folder: str | Path):
    """A Qwen2-VL processor without its video half, for machines without torchvision.

    transformers 5 refuses to build `Qwen2VLProcessor` when the video processor cannot load, and
    that one needs torchvision, which has no CPU build here. Images only need the PIL image
    processor, so this builds the same processor class minus the video attribute; it renders and
    tokenizes exactly like the full one for text and images (videos are not supported).
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder)
    processor_cls = _image_only_processor_class()
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
