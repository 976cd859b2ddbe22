"""Images: our resize path gives qwen-vl-utils' pixels; rows become OpenAI image parts; remote URLs are refused."""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest
from PIL import Image

from agentrl.data.dataset import DatasetError, validate_row
from agentrl.data.images import (
    ImageError,
    build_image_messages,
    encode_data_url,
    load_image,
    resize_image,
    smart_resize,
)

SIZES = [(30, 20), (100, 70), (500, 90), (224, 224), (640, 480), (57, 1000)]


def _picture(width: int, height: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(width * 1000 + height)
    channels = 4 if mode == "RGBA" else 3
    return Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)


@pytest.fixture
def qwen_vl_utils(monkeypatch):
    """qwen-vl-utils' vision_process module. It imports torchvision at module level for its video code; where
    torchvision does not load (no CPU build here), an empty stand-in lets the image functions, which never
    touch it, import and run as shipped."""
    try:
        yield importlib.import_module("qwen_vl_utils.vision_process")  # torchvision loads: as shipped
        return
    except ModuleNotFoundError as error:
        if error.name == "qwen_vl_utils":
            pytest.skip("qwen-vl-utils is not installed (make setup installs it)")
    except Exception:  # torchvision missing or failing to load its operators
        pass
    stand_in = types.ModuleType("torchvision")
    stand_in.__version__ = "0.0"
    stand_in.io = types.ModuleType("torchvision.io")
    stand_in.transforms = types.SimpleNamespace(InterpolationMode=types.SimpleNamespace(BICUBIC=3))
    monkeypatch.setitem(sys.modules, "torchvision", stand_in)
    monkeypatch.setitem(sys.modules, "torchvision.io", stand_in.io)
    monkeypatch.setitem(sys.modules, "torchvision.transforms", stand_in.transforms)
    for name in [m for m in sys.modules if m.startswith("qwen_vl_utils")]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("qwen_vl_utils.vision_process")
    yield module
    for name in [m for m in sys.modules if m.startswith("qwen_vl_utils")]:
        del sys.modules[name]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("bounds", [(56 * 56, 224 * 224), (4 * 28 * 28, 1280 * 28 * 28)])
def test_our_resize_gives_qwen_vl_utils_pixels(qwen_vl_utils, size, bounds, monkeypatch):
    import agentrl.data.images as images

    monkeypatch.setattr(images, "_fetch_with_qwen_vl_utils", lambda: None)  # force our own path
    min_pixels, max_pixels = bounds
    for mode in ("RGB", "RGBA"):
        picture = _picture(*size, mode=mode)
        theirs = qwen_vl_utils.fetch_image(
            {"image": picture, "min_pixels": min_pixels, "max_pixels": max_pixels}, image_patch_size=14
        )
        ours = resize_image(
            picture, patch_size=14, merge_size=2, min_pixels=min_pixels, max_pixels=max_pixels
        )
        assert ours.size == theirs.size
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))
        h, w = size[1], size[0]
        assert smart_resize(h, w, 28, min_pixels, max_pixels) == qwen_vl_utils.smart_resize(
            h, w, 28, min_pixels, max_pixels
        )


def test_smart_resize_bounds_and_factor():
    for w, h in SIZES:
        rh, rw = smart_resize(h, w, 28, 56 * 56, 224 * 224)
        assert rh % 28 == 0 and rw % 28 == 0 and 56 * 56 <= rh * rw <= 224 * 224
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(10, 3000, 28, 56 * 56, 224 * 224)


def test_verl_rows_become_image_url_parts(tmp_path):
    path = tmp_path / "a.png"
    _picture(40, 30).save(path)
    pil = _picture(20, 20)
    messages = build_image_messages(
        [{"role": "user", "content": "Left <image> right <image> done"}], [str(path), pil], "row 0"
    )
    parts = messages[0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "text", "image_url", "text"]
    assert np.array_equal(
        np.asarray(load_image(parts[1]["image_url"]["url"])), np.asarray(load_image(str(path)))
    )
    assert np.array_equal(np.asarray(load_image(parts[3]["image_url"]["url"])), np.asarray(pil))
    # No placeholder: the images go before the user's text, as verl does.
    plain = build_image_messages([{"role": "user", "content": "Count"}], [pil], "row 1")
    assert [p["type"] for p in plain[0]["content"]] == ["image_url", "text"]
    # OpenAI parts with a path or a PIL image become data URLs; a data URL passes untouched.
    url = encode_data_url(pil)
    parts = build_image_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": pil},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        None,
        "row 2",
    )[0]["content"]
    assert parts[0]["image_url"]["url"] == url and parts[1]["image_url"]["url"] == url
    with pytest.raises(ImageError, match=r"row 3: field 'prompt\[0\].content' has more <image>"):
        build_image_messages([{"role": "user", "content": "<image><image>"}], [pil], "row 3")


def test_remote_images_are_refused_naming_row_and_field():
    row = {
        "prompt": [{"role": "user", "content": "<image>What?"}],
        "images": ["https://example.com/cat.png"],
        "data_source": "x",
        "reward_model": {"ground_truth": "1"},
    }
    with pytest.raises(DatasetError, match=r"train.jsonl: row 7: field 'images\[0\]'.*not downloaded"):
        validate_row(row, 7, "train.jsonl")
    parts = {**row, "images": None}
    parts["prompt"] = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    ]
    with pytest.raises(DatasetError, match=r"row 2: field 'prompt\[0\].content\[0\].image_url'"):
        validate_row(parts, 2, "train.jsonl")
    with pytest.raises(ImageError, match=r"row 5: field 'images\[0\]': remote image URL"):
        build_image_messages(row["prompt"], row["images"], "row 5")
    mismatch = {**row, "images": [_picture(10, 10), _picture(10, 10)]}
    with pytest.raises(DatasetError, match="has 2 images but prompt has 1 <image>"):
        validate_row(mismatch, 0, "rows")


def test_a_changed_file_is_read_again_and_a_missing_one_names_its_row(tmp_path):
    """Files are encoded once per version: rewriting the picture at the same path gives the new pixels."""
    path = tmp_path / "a.png"
    first, second = _picture(40, 30), _picture(30, 40)
    first.save(path)

    def url() -> str:
        return build_image_messages([{"role": "user", "content": "<image>"}], [str(path)], "row 0")[0][
            "content"
        ][0]["image_url"]["url"]

    assert url() == url() == encode_data_url(first)
    second.save(path)
    assert np.array_equal(np.asarray(load_image(url())), np.asarray(second))
    path.unlink()
    with pytest.raises(FileNotFoundError, match="row 0: field 'images\\[0\\]'"):
        url()


def test_resized_data_urls_are_cached_per_picture_and_processor_settings():
    """A group's n requests send one picture n times: resized once per processor setting, same pixels."""
    import agentrl.data.images as images

    picture = _picture(100, 70)
    url = encode_data_url(picture)

    class Processor:  # the four settings resized_data_url reads from a Qwen2-VL image processor
        patch_size, merge_size, min_pixels = 14, 2, 56 * 56

        def __init__(self, max_pixels: int) -> None:
            self.max_pixels = max_pixels

    small, large = Processor(56 * 56), Processor(224 * 224)
    before = len(images._RESIZED_URLS.entries)
    once = images.resized_data_url(url, small)
    assert images.resized_data_url(url, small) is once  # the cached string itself
    assert len(images._RESIZED_URLS.entries) == before + 1
    expected = resize_image(picture, patch_size=14, merge_size=2, min_pixels=56 * 56, max_pixels=56 * 56)
    assert np.array_equal(np.asarray(load_image(once)), np.asarray(expected))
    other = images.resized_data_url(url, large)
    assert load_image(other).size != load_image(once).size
    assert len(images._RESIZED_URLS.entries) == before + 2
    # A PIL image (no content key without encoding it) is resized each time, and gives the same pixels.
    assert images.resized_data_url(picture, small) == once
