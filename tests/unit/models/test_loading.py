import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from agentrl.data.images import load_image
from agentrl.models import load_causal_lm, load_processor, load_tokenizer


def make_image(width=100, height=80):
    pixels = (np.arange(height * width * 3) % 251).astype("uint8").reshape(height, width, 3)
    return Image.fromarray(pixels)


def test_load_tokenizer_resolves_tiny_spec(model_cache, mini_path):
    tok = load_tokenizer("tiny:qwen2-mini")
    assert tok.name_or_path == mini_path and tok.eos_token_id == 2


def test_load_causal_lm_dtype(mini_path):
    model = load_causal_lm(mini_path, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_load_causal_lm_rejects_unknown_dtype(mini_path):
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        load_causal_lm(mini_path, dtype="fp8")


def test_vl_folder_has_processor_files(vl_path):
    import json

    config = json.load(open(f"{vl_path}/preprocessor_config.json"))
    assert config["min_pixels"] == 56 * 56 and config["max_pixels"] == 224 * 224
    assert config["image_processor_type"] == "Qwen2VLImageProcessor"
    model_config = json.load(open(f"{vl_path}/config.json"))
    assert model_config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert model_config["image_token_id"] == 9 and model_config["vision_start_token_id"] == 7


def test_qwen3_vl_folder_has_its_processor_and_deepstack_config(vl3_path):
    import json

    config = json.load(open(f"{vl3_path}/preprocessor_config.json"))
    assert (config["min_pixels"], config["max_pixels"], config["patch_size"]) == (64 * 64, 256 * 256, 16)
    assert config["processor_class"] == "Qwen3VLProcessor" and config["image_mean"] == [0.5] * 3
    model_config = json.load(open(f"{vl3_path}/config.json"))
    assert model_config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert model_config["image_token_id"] == 9 and model_config["vision_start_token_id"] == 7
    text, vision = model_config["text_config"], model_config["vision_config"]
    assert vision["out_hidden_size"] == text["hidden_size"] == 128
    assert vision["deepstack_visual_indexes"] == [0, 1]
    rope = text["rope_parameters"]
    assert rope["mrope_interleaved"] is True and sum(rope["mrope_section"]) == 32 // 2  # head_dim / 2
    assert model_config["tie_word_embeddings"] is True


# 80x100 pixels -> resized to multiples of patch x merge -> (grid, image tokens after the 2x2 merge, patch size).
# Qwen2-VL: 84x112 -> 6x8 patches of 14 -> 12 tokens. Qwen3-VL: 64x96 -> 4x6 patches of 16 -> 6 tokens.
@pytest.mark.parametrize(
    ("fixture", "grid", "tokens", "patch"),
    [("vl_path", [1, 6, 8], 12, 14), ("vl3_path", [1, 4, 6], 6, 16)],
)
def test_vl_processor_generate_and_backward(request, fixture, grid, tokens, patch):
    path = request.getfixturevalue(fixture)
    processor = load_processor(path)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    inputs = processor(text=[text], images=[make_image()], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [grid]
    assert (inputs["input_ids"] == 9).sum().item() == tokens
    assert inputs["pixel_values"].shape == (tokens * 4, 3 * 2 * patch * patch)

    model = load_causal_lm(path)
    out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    model.train()
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss)
    vision_grad = model.model.visual.patch_embed.proj.weight.grad
    assert vision_grad is not None and vision_grad.abs().sum() > 0


def test_load_image_from_path_data_url_and_pil(tmp_path):
    image = make_image(30, 20)
    path = tmp_path / "x.png"
    image.save(path)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    for ref in (
        str(path),
        f"file://{path}",
        data_url,
        image,
        {"type": "image_url", "image_url": {"url": data_url}},
    ):
        loaded = load_image(ref)
        assert loaded.size == (30, 20) and np.array_equal(np.asarray(loaded), np.asarray(image))
    with pytest.raises(FileNotFoundError, match="missing.png"):
        load_image(str(tmp_path / "missing.png"))
