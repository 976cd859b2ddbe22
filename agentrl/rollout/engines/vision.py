"""Images in the embedded engine: expand image placeholders, and prefill slot-cache rows with pixels.

A chat template renders each image part as one `<|image_pad|>` between `<|vision_start|>` and
`<|vision_end|>`. `build_image_prompt` resizes every image by qwen-vl-utils' rules, runs the image
processor (`agentrl.data.images`) and repeats each pad `t*h*w / merge**2` times, so the prompt ids are
exactly the tokens the model reads, pads included (what traces keep and training replays).

A vision-language model decodes on the slot cache like a text model (`_slot_batch.py`); `ImagePrefill` is
what its prefill adds. Positions are the model's multimodal rotary positions, from its own `get_rope_index`
over the whole prompt (what a teacher-forced forward in training computes): three components t/h/w over image
tokens, text after an image continuing from the image's largest position. Every token after the prompt has
three equal components, its cache index plus the sequence's offset (`PromptImages.offset`, transformers'
`rope_deltas`), the one integer per slot the decode step adds. The vision tower runs at prefill only, once per
distinct image of an admission (a GRPO group sends the same image n times) and only for images not already in
a reused prefix; its features replace the pad embeddings, and Qwen3-VL's deepstack features (vision-block
outputs added to the image tokens' hidden states after the first decoder layers) go into the same forward.

Pads of images of the same size are the same token ids whatever the pixels, so the prefix cache and the
admission's identical-prompt check key prompts by `prefix_key`, where each pad names its image's content.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.data.images import build_pixel_inputs, count_image_tokens, resized_data_url
from agentrl.rollout.engines._slot_decode import PackedVision, text_config

IMAGE_PART_TYPES = ("image_url", "image")


@dataclass
class ImageInputs:
    """The pixels behind a prompt's image pads: `images` (resized PNG data URLs, the reference traces
    keep), `pixel_values` (patches, C*T*P*P) and `image_grid_thw` (n_images, 3) long."""

    images: list[str]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    _digests: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    def digests(self) -> list[int]:
        """One 63-bit content hash per image: of its data URL (the pixels are a function of it), or of its
        patches when the references do not match the grid."""
        if self._digests is None:
            grid = self.image_grid_thw.tolist()
            if len(self.images) == len(grid):
                blobs = [f"{url}|{g}".encode() for url, g in zip(self.images, grid, strict=True)]
            else:
                sizes = [t * h * w for t, h, w in grid]
                patches = self.pixel_values.split(sizes)
                blobs = [
                    p.contiguous().float().numpy().tobytes() + str(g).encode()
                    for p, g in zip(patches, grid, strict=True)
                ]
            self._digests = [
                int.from_bytes(hashlib.blake2b(b, digest_size=8).digest(), "little") >> 1 for b in blobs
            ]
        return self._digests


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
    images = [resized_data_url(ref, image_processor, field) for field, ref in refs]
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


def prefix_key(
    prompt: list[int], images: ImageInputs | None, image_token_id: int, merge_size: int
) -> list[int]:
    """The prompt's ids as the prefix cache compares them: each image pad replaced by a negative id (outside
    the vocabulary) naming its image's content, so equal keys mean equal tokens and equal pixels."""
    if images is None:
        return prompt
    names = [
        -1 - digest
        for digest, count in zip(
            images.digests(), count_image_tokens(images.image_grid_thw, merge_size), strict=True
        )
        for _ in range(count)
    ]
    key, pad = [], 0
    for token in prompt:
        if token == image_token_id:
            key.append(names[pad])
            pad += 1
        else:
            key.append(token)
    return key


@dataclass
class PromptImages:
    """One admitted prompt's images as its prefill reads them."""

    rope: torch.Tensor
    """(3, T) long, on the host: the whole prompt's multimodal rotary positions."""
    offset: int
    """Rotary position minus cache index of every token after the prompt (transformers' `rope_deltas`)."""
    pads_before: list[int]
    """(T + 1): pads among the prompt's first t tokens."""
    first_pad: int
    """Ordinal of the first pad whose features are computed (pads of images inside a reused prefix are not)."""
    features: torch.Tensor
    """(pads from `first_pad` on, H) on the model's device: the vision tower's features of those pads."""
    deepstack: list[torch.Tensor] = field(default_factory=list)
    """Qwen3-VL: per early decoder layer, the same pads' deepstack features."""


class ImagePrefill:
    """The image side of a vision-language model's slot-cache prefill: prefix keys, vision tower, positions."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.image_token_id = int(model.config.image_token_id)
        self.merge_size = int(model.config.vision_config.spatial_merge_size)

    @property
    def _core(self) -> torch.nn.Module:
        """The multimodal model (vision tower, `get_rope_index`) under the LM head."""
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return inner.model

    def key(self, prompt: list[int], images: ImageInputs | None) -> list[int]:
        return prefix_key(prompt, images, self.image_token_id, self.merge_size)

    @torch.inference_mode()
    def prepare(
        self, prompts: dict[int, list[int]], images: dict[int, ImageInputs], starts: dict[int, int]
    ) -> dict[int, PromptImages]:
        """For each prompt i with images: positions, offset, and the features of its pads at or after
        `starts[i]` (the first token its prefill computes). The tower runs once over the distinct images
        those pads belong to."""
        needed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # digest -> (patches, grid row)
        plans = {}
        for i, inputs in images.items():
            prompt, grid = prompts[i], inputs.image_grid_thw
            pads_before = [0]
            for token in prompt:
                pads_before.append(pads_before[-1] + (token == self.image_token_id))
            counts = count_image_tokens(grid, self.merge_size)
            patches = inputs.pixel_values.split([int(t * h * w) for t, h, w in grid.tolist()])
            first_pad, ends, skip = 0, 0, 0
            for j, count in enumerate(counts):
                ends += count
                if ends <= pads_before[starts[i]]:  # wholly inside the reused prefix
                    first_pad, skip = ends, j + 1
            digests = inputs.digests()[skip:]
            for j, digest in enumerate(digests, start=skip):
                needed.setdefault(digest, (patches[j], grid[j : j + 1]))
            plans[i] = (pads_before, first_pad, digests)
        features = self._encode(needed)
        out = {}
        for i, (pads_before, first_pad, digests) in plans.items():
            rope, offset = self._positions(prompts[i], images[i])
            per_image = [features[d] for d in digests]
            out[i] = PromptImages(
                rope=rope,
                offset=offset,
                pads_before=pads_before,
                first_pad=first_pad,
                features=torch.cat([f[0] for f in per_image]) if per_image else self._no_features(),
                deepstack=[torch.cat(layer) for layer in zip(*(f[1] for f in per_image), strict=True)]
                if per_image
                else [],
            )
        return out

    def _encode(
        self, images: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[int, tuple[torch.Tensor, list[torch.Tensor]]]:
        """digest -> (its pads' features (pads, H), its deepstack features per layer): one tower forward."""
        if not images:
            return {}
        device = next(self.model.parameters()).device
        pixels = torch.cat([p for p, _ in images.values()]).to(device)
        grid = torch.cat([g for _, g in images.values()]).to(device)
        out = self._core.get_image_features(pixels, grid, return_dict=True)
        deepstack = getattr(out, "deepstack_features", None) or []
        return {
            digest: (out.pooler_output[k], [layer[k] for layer in deepstack])
            for k, digest in enumerate(images)
        }

    def _positions(self, prompt: list[int], images: ImageInputs) -> tuple[torch.Tensor, int]:
        """(3, T) rotary positions of the prompt and its offset, by the model's own `get_rope_index`."""
        ids = torch.tensor([prompt])
        rope, deltas = self._core.get_rope_index(
            ids, mm_token_type_ids=(ids == self.image_token_id).int(), image_grid_thw=images.image_grid_thw
        )
        return rope[:, 0], int(deltas.reshape(-1)[0])

    def _no_features(self) -> torch.Tensor:
        weight = self.model.get_input_embeddings().weight
        return weight.new_zeros(0, text_config(self.model).hidden_size)

    def pack(self, parts: list[tuple[list[int], int, PromptImages | None]]) -> PackedVision | None:
        """The `PackedVision` of one packed prefill of `parts` (a chunk's ids, its first position, and its
        prompt's images or None); None when no part has images (positions are then the cache indices)."""
        if all(images is None for _, _, images in parts):
            return None
        ropes, masks, embeds, deepstack = [], [], [], []
        for ids, start, images in parts:
            end = start + len(ids)
            if images is None:
                ropes.append(torch.arange(start, end).expand(3, -1))
                masks.append(torch.zeros(len(ids), dtype=torch.bool))
                continue
            ropes.append(images.rope[:, start:end])
            masks.append(torch.tensor(ids) == self.image_token_id)
            first, last = (
                images.pads_before[start] - images.first_pad,
                images.pads_before[end] - images.first_pad,
            )
            if last > first:
                embeds.append(images.features[first:last])
                deepstack.append([layer[first:last] for layer in images.deepstack])
        device = next(self.model.parameters()).device
        return PackedVision(
            rope_positions=torch.cat(ropes, dim=1).to(device),
            mask=torch.cat(masks).to(device),
            embeds=torch.cat(embeds) if embeds else self._no_features(),
            deepstack=[torch.cat(layer) for layer in zip(*deepstack, strict=True)] if deepstack else [],
        )
