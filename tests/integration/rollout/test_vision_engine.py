"""The embedded engine with images: pads expanded, vision tower and mrope in prefill, raw logprobs exact.

Every test runs on both tiny families: Qwen2-VL and Qwen3-VL (deepstack features, interleaved mrope).
"""

import asyncio

import pytest
import torch
from PIL import Image, ImageDraw

from agentrl.data.images import build_pixel_inputs, encode_data_url
from agentrl.models import load_causal_lm, load_tokenizer
from agentrl.rollout.chat import render_chat
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.rollout.engines.vision import build_image_prompt, collect_image_refs
from agentrl.types import SamplingParams

pytestmark = pytest.mark.slow


def _diverse_vl_model(spec: str):
    """The tiny VL preset with larger random weights, so greedy text depends on the picture."""
    model = load_causal_lm(spec)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def _picture(colour: str, size=(90, 60)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).ellipse((10, 10, 50, 50), fill=colour)
    return image


@pytest.fixture(scope="module", params=["tiny:qwen2-vl", "tiny:qwen3-vl"])
def setup(request):
    model = _diverse_vl_model(request.param)
    tokenizer = load_tokenizer(request.param)
    engine = EmbeddedEngine(model, tokenizer, max_num_seqs=16, max_model_len=256)
    yield model, tokenizer, engine
    engine.close()


def _image_prompt(engine, tokenizer, image, text="How many shapes?"):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": encode_data_url(image)}},
                {"type": "text", "text": text},
            ],
        }
    ]
    ids = render_chat(tokenizer, messages)
    image_token = engine.model.config.image_token_id
    return build_image_prompt(ids, collect_image_refs(messages), engine.image_processor, image_token)


def _teacher_forced(model, prompt, completion, images):
    """Log p(completion | prompt, pixels) from one plain forward, positions computed by the HF model."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            pixel_values=images.pixel_values,
            image_grid_thw=images.image_grid_thw,
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
        ).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def test_prompt_holds_one_pad_per_image_token(setup):
    model, tokenizer, engine = setup
    prompt, images = _image_prompt(engine, tokenizer, _picture("red"))
    pads = prompt.count(model.config.image_token_id)
    t, h, w = images.image_grid_thw[0].tolist()
    assert pads == t * h * w // 4 and pads > 1
    assert images.pixel_values.shape[0] == t * h * w
    # The trace's reference rebuilds exactly these pixels.
    rebuilt = build_pixel_inputs(engine.image_processor, images.images)
    assert torch.equal(rebuilt["pixel_values"], images.pixel_values)


def test_image_logprobs_equal_teacher_forced_forward(setup):
    model, tokenizer, engine = setup
    red, images_red = _image_prompt(engine, tokenizer, _picture("red"))
    blue, images_blue = _image_prompt(engine, tokenizer, _picture("blue", (120, 40)), "Colour?")
    text = render_chat(tokenizer, [{"role": "user", "content": "What is 2+3?"}])

    async def run():
        return await asyncio.gather(
            engine.generate(
                red, SamplingParams(temperature=1.0, max_tokens=24, n=2, seed=3), images=images_red
            ),
            engine.generate(blue, SamplingParams(temperature=0.0, max_tokens=24), images=images_blue),
            engine.generate(text, SamplingParams(temperature=0.0, max_tokens=24)),
        )

    sampled, greedy_blue, greedy_text = asyncio.run(run())
    for prompt, images, out in [(red, images_red, o) for o in sampled] + [
        (blue, images_blue, greedy_blue[0])
    ]:
        expected = _teacher_forced(model, prompt, out.token_ids, images)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4), (out.logprobs, expected)
    with torch.no_grad():
        ref = model.generate(torch.tensor([text]), do_sample=False, max_new_tokens=24)[0, len(text) :]
    assert greedy_text[0].token_ids[: len(ref)] == ref.tolist()[: len(greedy_text[0].token_ids)]


def test_pixels_change_the_answer_and_pad_count_is_checked(setup):
    model, tokenizer, engine = setup
    red, images_red = _image_prompt(engine, tokenizer, _picture("red"))
    green, images_green = _image_prompt(engine, tokenizer, _picture("green"))
    assert red == green  # same size: same tokens, only pixels differ

    async def run(prompt, images):
        return await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), images=images)

    first = asyncio.run(run(red, images_red))[0].logprobs
    second = asyncio.run(run(green, images_green))[0].logprobs
    assert first != second
    extra_pad = red[:1] + [model.config.image_token_id] + red[1:]
    with pytest.raises(ValueError, match="image pad tokens"):
        asyncio.run(run(extra_pad, images_red))
