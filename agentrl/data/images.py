"""Images for vision-language policies: loading, Qwen-VL resizing, data URLs and pixel inputs.

One path from an image reference to the tensors a Qwen2-VL or Qwen3-VL model reads, used by the dataset, the
engine and training alike, so the pixels training sees are the ones the engine saw:

1. `load_image`: a PIL image, a local path, `file://` or a `data:` base64 URL (offline: http(s) is
   refused with an error naming where the reference came from);
2. `resize_image`: qwen-vl-utils' `fetch_image` rules (`smart_resize` to multiples of patch x merge
   within `min_pixels`/`max_pixels`, PIL bicubic). qwen-vl-utils is used where it imports; it imports
   torchvision at module level, which has no CPU build here, so the same rules are written out below
   (tests/unit/data/test_images.py shows the two give identical pixels);
3. `encode_data_url`: the resized image as a PNG data URL, the reference traces keep (`resized_data_url`
   does 1-3 for a request's image, once per picture: a GRPO group sends the same one n times);
4. `build_pixel_inputs`: the processor's `pixel_values` and `image_grid_thw` from resized images
   (`do_resize=False`: the image already has its final size), cached by content so the trainer
   reuses the engine's tensors in one process and recomputes identical ones in another.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.recent_map import RecentMap

if TYPE_CHECKING:
    from PIL import Image

MAX_RATIO = 200
"""Largest aspect ratio qwen-vl-utils accepts."""


class ImageError(ValueError):
    """An image reference could not be turned into an image; the message names where it came from."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with area in [min_pixels, max_pixels], aspect kept.

    The rule of qwen-vl-utils' `smart_resize` (and transformers' Qwen2-VL image processor).
    """
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ImageError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above {MAX_RATIO}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGBA on a white background (as qwen-vl-utils does), anything else converted to RGB."""
    from PIL import Image

    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        return background
    return image.convert("RGB")


def load_image(ref: Any, where: str = "image") -> Image.Image:
    """An RGB PIL image from a PIL image, a path, a `file://` or `data:image/...;base64,` URL, or an
    OpenAI part / verl dict (`{"image_url": {"url"}}`, `{"image"}`, `{"bytes"}`, `{"path"}`).

    `where` names the reference in errors (e.g. "data/train.jsonl: row 3: field 'images[0]'").
    """
    from PIL import Image

    if isinstance(ref, Image.Image):
        return _to_rgb(ref)
    if isinstance(ref, dict):
        if ref.get("bytes") is not None:
            return _to_rgb(Image.open(io.BytesIO(ref["bytes"])))
        inner = ref.get("image_url") or ref.get("image") or ref.get("url") or ref.get("path")
        if isinstance(inner, dict):
            inner = inner.get("url")
        return load_image(inner, where)
    if not isinstance(ref, str):
        raise ImageError(f"{where}: unsupported image reference of type {type(ref).__name__}")
    if ref.startswith(("http://", "https://")):
        raise ImageError(
            f"{where}: remote image URL {ref[:80]!r} refused: images are not downloaded at run time; "
            "save it to a file and give its path, or a data:image/...;base64 URL"
        )
    if ref.startswith("data:"):
        header, _, payload = ref.partition(",")
        if not header.startswith("data:image") or ";base64" not in header:
            raise ImageError(f"{where}: a data URL must be data:image/<format>;base64,<payload>")
        try:
            return _to_rgb(Image.open(io.BytesIO(base64.b64decode(payload))))
        except Exception as exc:  # binascii.Error, PIL.UnidentifiedImageError
            raise ImageError(f"{where}: the data URL does not hold a readable image: {exc}") from exc
    path = ref.removeprefix("file://")
    if not Path(path).exists():
        raise FileNotFoundError(f"{where}: image file not found: {path}")
    return _to_rgb(Image.open(path))


@functools.cache
def _fetch_with_qwen_vl_utils():
    """qwen-vl-utils' `fetch_image`, or None where it does not import (no torchvision); tried once, since a
    failed import is not cached by Python and would run again for every image."""
    try:
        from qwen_vl_utils import fetch_image
    except Exception:  # ImportError, or torchvision failing to load its operators
        return None
    return fetch_image


def resize_image(image: Image.Image, *, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int):
    """`image` resized by qwen-vl-utils' rules (through qwen-vl-utils itself where it imports)."""
    fetch_image = _fetch_with_qwen_vl_utils()
    if fetch_image is not None and merge_size == 2:  # qwen-vl-utils hard-codes a 2x2 merge
        return fetch_image({"image": image, "min_pixels": min_pixels, "max_pixels": max_pixels}, patch_size)
    image = _to_rgb(image)
    height, width = smart_resize(image.height, image.width, patch_size * merge_size, min_pixels, max_pixels)
    return image.resize((width, height))  # PIL's default resampling for RGB: bicubic, as qwen-vl-utils


def resized_data_url(ref: Any, image_processor: Any, where: str = "image") -> str:
    """The PNG data URL of `ref` resized for `image_processor` (what the engine reads and traces keep).

    A `data:` reference is cached by its content: the n answers of a GRPO group send the same picture n
    times, and decoding, resizing and re-encoding it is most of a request's host time.
    """
    settings = processor_resize_settings(image_processor)

    def make() -> str:
        return encode_data_url(resize_image(load_image(ref, where), **settings))

    if not (isinstance(ref, str) and ref.startswith("data:")):
        return make()
    return _RESIZED_URLS.get_or_make((*settings.values(), hashlib.sha256(ref.encode()).hexdigest()), make)


def processor_resize_settings(image_processor: Any) -> dict[str, int]:
    size = getattr(image_processor, "size", None) or {}
    min_pixels = getattr(image_processor, "min_pixels", None) or size.get("shortest_edge")
    max_pixels = getattr(image_processor, "max_pixels", None) or size.get("longest_edge")
    return {
        "patch_size": int(image_processor.patch_size),
        "merge_size": int(image_processor.merge_size),
        "min_pixels": int(min_pixels),
        "max_pixels": int(max_pixels),
    }


def encode_data_url(image: Image.Image) -> str:
    """A lossless PNG `data:` URL: decoding it gives back exactly these pixels."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@functools.cache
def load_image_processor(model_path: str) -> Any:
    """The image processor saved beside a vision-language model (HF id, folder or `tiny:` preset)."""
    from agentrl.models import load_processor

    return load_processor(model_path).image_processor


_MiB = 1 << 20
_PIXEL_INPUTS = RecentMap(1024 * _MiB, lambda hit: hit["pixel_values"].nbytes)
_RESIZED_URLS = RecentMap(256 * _MiB, len)  # data URLs: a 1,000 x 1,000 picture is ~2 MB of base64
_FILE_URLS = RecentMap(256 * _MiB, len)


def build_pixel_inputs(image_processor: Any, images: list[str]) -> dict[str, Any]:
    """`{"pixel_values": (patches, C*T*P*P) float, "image_grid_thw": (n, 3) long}` for resized images.

    `images` are PNG data URLs of already resized images (`encode_data_url(resize_...)`): the processor
    runs with `do_resize=False`, so the pixels are exactly those of the image. Results are cached per
    image (keyed by its URL's hash), so the trainer of this process reuses the engine's tensors.
    """
    import torch

    values, grids = [], []
    for url in images:

        def make(url: str = url) -> dict[str, Any]:
            out = image_processor(images=[load_image(url)], do_resize=False, return_tensors="pt")
            return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

        hit = _PIXEL_INPUTS.get_or_make((id(image_processor), hashlib.sha256(url.encode()).hexdigest()), make)
        values.append(hit["pixel_values"])
        grids.append(hit["image_grid_thw"])
    return {"pixel_values": torch.cat(values), "image_grid_thw": torch.cat(grids).long()}


def count_image_tokens(image_grid_thw: Any, merge_size: int) -> list[int]:
    """Placeholder tokens each image takes in the prompt: t * h * w / merge_size**2."""
    return [int(t * h * w) // (merge_size**2) for t, h, w in image_grid_thw.tolist()]


IMAGE_PLACEHOLDER = "<image>"
"""verl's placeholder: each occurrence in a prompt's text takes the row's next `images` entry."""

_IMAGE_PART_TYPES = ("image_url", "image")


def build_image_messages(messages: list[dict[str, Any]], images: list[Any] | None, where: str) -> list[dict]:
    """OpenAI chat messages whose images are `image_url` parts holding `data:` URLs.

    Accepts verl's format (`<image>` placeholders in text, the pictures in `images`) and OpenAI content
    parts (`{"type": "image_url", "image_url": {"url": ...}}` or `{"type": "image", "image": ...}`) whose
    references are paths, data URLs or PIL images. `where` names the row in errors ("file: row 3").
    """
    images = list(images or [])
    used = 0
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            pieces = content.split(IMAGE_PLACEHOLDER)
            parts: list[dict[str, Any]] = []
            for k, text in enumerate(pieces):
                if text:
                    parts.append({"type": "text", "text": text})
                if k < len(pieces) - 1:
                    if used >= len(images):
                        raise ImageError(
                            f"{where}: field 'prompt[{i}].content' has more {IMAGE_PLACEHOLDER} placeholders "
                            f"than the row's {len(images)} 'images'"
                        )
                    parts.append(_image_part(images[used], f"{where}: field 'images[{used}]'"))
                    used += 1
            message = {**message, "content": parts}
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _IMAGE_PART_TYPES:
                    part = _image_part(part, f"{where}: field 'prompt[{i}].content[{j}]'")
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    if used != len(images) and used:
        raise ImageError(
            f"{where}: field 'images' has {len(images)} images but the prompt has {used} "
            f"{IMAGE_PLACEHOLDER} placeholders"
        )
    if images and not used:  # no placeholders: verl puts the images before the first user text
        first_user = next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
        if first_user is None:
            raise ImageError(f"{where}: field 'images' is set but the prompt has no user message")
        content = out[first_user].get("content")
        text_parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        image_parts = [_image_part(img, f"{where}: field 'images[{k}]'") for k, img in enumerate(images)]
        out[first_user] = {**out[first_user], "content": image_parts + text_parts}
    return out


def _image_part(ref: Any, where: str) -> dict[str, Any]:
    """`{"type": "image_url", "image_url": {"url": data URL}}`; a data URL passes through untouched."""
    if isinstance(ref, dict) and ref.get("type") in _IMAGE_PART_TYPES:
        inner = ref.get("image_url") if ref["type"] == "image_url" else ref.get("image")
        ref = inner.get("url") if isinstance(inner, dict) else inner
    if isinstance(ref, str) and ref.startswith("data:image"):
        return {"type": "image_url", "image_url": {"url": ref}}
    return {"type": "image_url", "image_url": {"url": _file_data_url(ref, where)}}


def _file_data_url(ref: Any, where: str) -> str:
    """`ref` as a PNG data URL; a file is encoded once per version (path, size, modification time), since
    every answer of a group sends the same picture."""
    path = ref.removeprefix("file://") if isinstance(ref, str) and not ref.startswith("data:") else None
    try:
        stat = Path(path).stat() if path else None
    except OSError:  # missing or unreadable: load_image says so, naming `where`
        stat = None
    if stat is None:
        return encode_data_url(load_image(ref, where))
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    return _FILE_URLS.get_or_make(key, lambda: encode_data_url(load_image(ref, where)))


def has_image_parts(messages: Any) -> bool:
    """Whether any message holds an image part (OpenAI `image_url`, or `image`)."""
    for message in messages or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") in _IMAGE_PART_TYPES for p in content
        ):
            return True
    return False
