"""Images in the embedded engine: expand image placeholders, and prefill rows with pixels and mrope positions.

A chat template renders each image part as one `<|image_pad|>` between `<|vision_start|>` and
`<|vision_end|>`. `build_image_prompt` resizes every image by qwen-vl-utils' rules, runs the image
processor (`agentrl.data.images`) and repeats each pad `t*h*w / merge**2` times, so the prompt ids are
exactly the tokens the model reads, pads included (what traces keep and training replays).

`prefill_with_images` is the prefill of `_batch.prefill` for a vision-language model (`ImageBatch`, the
engine's running batch for such models, calls it when admitted prompts carry images): the vision
tower's features replace the pad embeddings, and positions are the model's multimodal rotary
positions (`get_rope_index`: three components t/h/w over image tokens, text after an image continuing
from the image's largest position). Each row's next position is its largest position + 1, so the
ordinary decode step (one position per row, which Qwen2-VL and Qwen3-VL broadcast to all three components)
goes on from there; decode needs nothing image-specific. Qwen3-VL's deepstack features (vision-block outputs
added to the image tokens' hidden states in the first decoder layers) are applied by the model in this same
forward, from the same pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from agentrl.data.images import (
    build_pixel_inputs,
    count_image_tokens,
    encode_data_url,
    load_image,
    resize_for_processor,
)
from agentrl.rollout.engines._batch import DynamicBatch, PaddedBatch, left_pad

IMAGE_PART_TYPES = ("image_url", "image")


@dataclass
class ImageInputs:
    """The pixels behind a prompt's image pads: `images` (resized PNG data URLs, the reference traces
    keep), `pixel_values` (patches, C*T*P*P) and `image_grid_thw` (n_images, 3) long."""

    images: list[str]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


def is_vision_language(model: torch.nn.Module) -> bool:
    return getattr(model.config, "vision_config", None) is not None


def placeholder_token_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """Image and video pad ids of a vision-language model, which the engine never samples: they stand for
    pixels, and a completion holding one could not be replayed in training (the model matches pads to
    image features by count). Empty for a text model."""
    if not is_vision_language(model):
        return ()
    ids = (getattr(model.config, "image_token_id", None), getattr(model.config, "video_token_id", None))
    return tuple(int(t) for t in ids if t is not None)


def collect_image_refs(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(`messages.i.content.j`, reference) of every image part, in prompt order."""
    refs = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                refs.append(
                    (f"messages.{i}.content.{j}.image_url", url.get("url") if isinstance(url, dict) else url)
                )
            elif kind == "image":
                refs.append((f"messages.{i}.content.{j}.image", part.get("image")))
    return refs


def build_image_prompt(
    prompt_ids: list[int], refs: list[tuple[str, Any]], image_processor: Any, image_token_id: int
) -> tuple[list[int], ImageInputs]:
    """Prompt ids with each single image pad expanded to its image's token count, and the pixel inputs.

    `refs` are (field, reference) pairs as `collect_image_refs` gives them; a reference that does not
    load raises ValueError naming its field.
    """
    images = [
        encode_data_url(resize_for_processor(load_image(ref, field), image_processor)) for field, ref in refs
    ]
    pads = [k for k, t in enumerate(prompt_ids) if t == image_token_id]
    if len(pads) != len(images):
        raise ValueError(
            f"messages: the rendered prompt has {len(pads)} image placeholders for {len(images)} image parts"
        )
    inputs = build_pixel_inputs(image_processor, images)
    counts = count_image_tokens(inputs["image_grid_thw"], int(image_processor.merge_size))
    expanded: list[int] = []
    for k, token in enumerate(prompt_ids):
        expanded.extend([token] * (counts[pads.index(k)] if token == image_token_id else 1))
    return expanded, ImageInputs(images, inputs["pixel_values"], inputs["image_grid_thw"])


def check_image_prompt(
    prompt_ids: list[int], images: ImageInputs, image_token_id: int, merge_size: int
) -> None:
    """ValueError unless the prompt holds exactly as many image pads as the pixels make tokens."""
    expected = sum(count_image_tokens(images.image_grid_thw, merge_size))
    found = sum(1 for t in prompt_ids if t == image_token_id)
    if expected != found:
        raise ValueError(f"prompt has {found} image pad tokens but its images make {expected}")


def rope_positions(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor, grid_thw: Any):
    """(3, B, T) multimodal rotary positions from the model's own `get_rope_index` (padding slots 0)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    mm_types = (input_ids == inner.config.image_token_id).int()
    positions, _ = inner.model.get_rope_index(
        input_ids, mm_token_type_ids=mm_types, image_grid_thw=grid_thw, attention_mask=mask
    )
    return positions


@torch.inference_mode()
def prefill_with_images(
    model: torch.nn.Module, prompts: list[list[int]], images: list[ImageInputs | None]
) -> tuple[PaddedBatch, torch.Tensor]:
    """`_batch.prefill` for rows of which some carry images: left-padded, pixels in row order, mrope
    positions; returns the batch (next position = largest position + 1) and last logits (B, V)."""
    device = next(model.parameters()).device
    input_ids, mask = left_pad(prompts, device)
    present = [x for x in images if x is not None]
    grid = torch.cat([x.image_grid_thw for x in present]).to(device)
    pixels = torch.cat([x.pixel_values for x in present]).to(device)
    positions = rope_positions(model, input_ids, mask, grid)
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        pixel_values=pixels,
        image_grid_thw=grid,
        past_key_values=DynamicCache(config=model.config),
        use_cache=True,
        logits_to_keep=1,
    )
    next_positions = positions.amax(dim=(0, 2)) + 1
    batch = PaddedBatch(cache=out.past_key_values, attention_mask=mask, positions=next_positions)
    return batch, out.logits[:, -1, :]


class ImageBatch(DynamicBatch):
    """`DynamicBatch` whose `admit` also takes each prompt's `ImageInputs` (None for a text prompt)."""

    def admit(
        self,
        prompts: list[list[int]],
        copies: list[int],
        reserve: int,
        images: list[ImageInputs | None] | None = None,
    ) -> torch.Tensor:
        if not images or all(x is None for x in images):
            return super().admit(prompts, copies, reserve)
        self.count_prefill(prompts)
        return self._join(*prefill_with_images(self.model, prompts, images), copies)
