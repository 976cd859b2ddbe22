"""The embedded engine with images: pads expanded, vision tower and mrope in prefill, decode on the slot cache,
raw logprobs exact (teacher forcing with pixels, fp32), next turns through the prefix cache.

Every test runs on both tiny families: Qwen2-VL and Qwen3-VL (deepstack features, interleaved mrope).
"""

import asyncio

import pytest
import torch
from PIL import Image, ImageDraw

from agentrl.data.images import build_pixel_inputs, encode_data_url
from agentrl.models import load_causal_lm, load_tokenizer
from agentrl.rollout.chat import render_chat
from agentrl.rollout.engines._slot_batch import SlotBatch
from agentrl.rollout.engines.embedded import EmbeddedEngine
from agentrl.rollout.engines.vision import ImageInputs, build_image_prompt, collect_image_refs
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


def test_an_image_row_moved_to_a_low_slot_keeps_its_rotary_offset(setup):
    """The last row running in a high slot moves to a low one (`SlotBatch.compact_rows`) with its multimodal
    rotary offset: its logprobs still equal a teacher-forced forward with the pixels. A fresh engine, so the
    slots are known: the 12 text rows take 0..11, the image row 12."""
    model, tokenizer, _ = setup
    engine = EmbeddedEngine(model, tokenizer, max_num_seqs=16, max_model_len=256)
    try:
        _assert_a_moved_image_row_equals_teacher_forcing(model, tokenizer, engine)
    finally:
        engine.close()


def _assert_a_moved_image_row_equals_teacher_forcing(model, tokenizer, engine):
    prompt, images = _image_prompt(engine, tokenizer, _picture("green"))
    text = render_chat(tokenizer, [{"role": "user", "content": "What is 2+3?"}])
    short = SamplingParams(temperature=1.0, max_tokens=3, n=12, ignore_eos=True)
    long = SamplingParams(temperature=1.0, max_tokens=30, seed=4, ignore_eos=True)

    async def run():
        crowd = asyncio.create_task(engine.generate(text, short))
        while engine.stats()["tokens_generated"] < generated + 12:  # the 12 text rows run in the low slots
            await asyncio.sleep(0.001)
        return await asyncio.gather(crowd, engine.generate(prompt, long, images=images))

    before, generated = engine.stats()["rows_compacted"], engine.stats()["tokens_generated"]
    _, (out,) = asyncio.run(run())
    assert engine.stats()["rows_compacted"] > before
    expected = _teacher_forced(model, prompt, out.token_ids, images)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4), (out.logprobs, expected)


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


def _count_tower_images(model):
    """A list that receives the number of images of every vision tower forward (a forward hook)."""
    seen: list[int] = []
    tower = model.model.visual
    handle = tower.register_forward_hook(
        lambda _m, args, kwargs, _o: seen.append(len(kwargs["grid_thw"])), with_kwargs=True
    )
    return seen, handle


def test_vlm_decodes_on_the_slot_cache(setup):
    model, tokenizer, engine = setup
    assert isinstance(engine._batch, SlotBatch)
    assert engine._batch.images is not None and engine.accepts_images


def _image_segment(prompt, model):
    """The tokens of a prompt's image: vision start, pads, vision end."""
    start, end = (
        prompt.index(model.config.vision_start_token_id),
        prompt.index(model.config.vision_end_token_id),
    )
    return prompt[start : end + 1]


@pytest.mark.parametrize("follow_up_tokens", [6, 90], ids=["extend", "prefill"])
def test_next_turn_after_an_image_reuses_the_prefix_and_equals_teacher_forcing(setup, follow_up_tokens):
    """Turn 2 extends turn 1 (prompt with an image + completion): the prefix cache hands over turn 1's slot and
    only the rest is computed, text positions continuing with turn 1's offset. A third turn brings a second image
    after the reused prefix: only that image goes through the vision tower."""
    model, tokenizer, engine = setup
    first, images = _image_prompt(engine, tokenizer, _picture("purple", (100, 70)), "Name the shape.")
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=11, ignore_eos=True)
    turn_1 = asyncio.run(engine.generate(first, params, images=images))[0]
    words = tokenizer.encode(" and what else is there" * 20, add_special_tokens=False)[:follow_up_tokens]
    second = first + turn_1.token_ids + words
    hits = engine.stats()["prefix_cache_hits"]
    seen, handle = _count_tower_images(model)
    try:
        turn_2 = asyncio.run(engine.generate(second, params, images=images))[0]
        assert engine.stats()["prefix_cache_hits"] - hits >= len(first) + len(turn_1.token_ids) - 1
        assert seen == []  # the image lies inside the reused prefix
        expected = _teacher_forced(model, second, turn_2.token_ids, images)
        assert torch.allclose(torch.tensor(turn_2.logprobs), expected, atol=1e-4), (turn_2.logprobs, expected)

        blue, blue_images = _image_prompt(engine, tokenizer, _picture("blue", (120, 40)), "Colour?")
        third = second + turn_2.token_ids + _image_segment(blue, model) + words[:5]
        both = ImageInputs(
            images.images + blue_images.images,
            torch.cat([images.pixel_values, blue_images.pixel_values]),
            torch.cat([images.image_grid_thw, blue_images.image_grid_thw]),
        )
        seen.clear()  # the teacher-forced forward ran the tower too
        turn_3 = asyncio.run(engine.generate(third, params, images=both))[0]
        assert seen == [1]
        expected = _teacher_forced(model, third, turn_3.token_ids, both)
        assert torch.allclose(torch.tensor(turn_3.logprobs), expected, atol=1e-4), (turn_3.logprobs, expected)
    finally:
        handle.remove()


def test_grpo_group_with_one_image_runs_the_tower_once(setup):
    """n completions of one image prompt, and sibling requests that send the same image with other text, in
    one admission: one vision tower forward over one image; every logprob equals teacher forcing."""
    model, tokenizer, engine = setup
    picture = _picture("orange", (80, 80))
    prompts = [_image_prompt(engine, tokenizer, picture, text) for text in ("Shape?", "Colour?", "Size?")]

    async def run():
        return await asyncio.gather(
            *(
                engine.generate(p, SamplingParams(temperature=1.0, max_tokens=12, n=4, seed=k), images=x)
                for k, (p, x) in enumerate(prompts)
            )
        )

    prefills = engine.stats()["prefills"]
    seen, handle = _count_tower_images(model)
    try:
        groups = asyncio.run(run())
    finally:
        handle.remove()
    if (
        engine.stats()["prefills"] == prefills + 1
    ):  # one admission (the usual case: the requests came together)
        assert seen == [1]
    assert sum(seen) <= len(prompts)
    for (prompt, images), outs in zip(prompts, groups, strict=True):
        assert len({tuple(o.token_ids) for o in outs}) > 1
        for out in outs:
            expected = _teacher_forced(model, prompt, out.token_ids, images)
            assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4), (out.logprobs, expected)
