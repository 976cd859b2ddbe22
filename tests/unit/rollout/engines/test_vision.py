"""vision.prefix_key: image pads named by their image's content, other ids unchanged."""

import torch

from agentrl.rollout.engines.vision import ImageInputs, prefix_key

PAD = 9


def _inputs(urls, grids):
    grid = torch.tensor(grids)
    patches = int(grid.prod(-1).sum())
    return ImageInputs(list(urls), torch.zeros(patches, 4), grid)


def test_text_prompt_is_its_own_key():
    prompt = [1, 2, 3]
    assert prefix_key(prompt, None, PAD, 2) is prompt


def test_pads_take_one_negative_id_per_image():
    # Two images of 1x2x4 patches: 2 pads each at merge 2.
    images = _inputs(["data:a", "data:b"], [[1, 2, 4], [1, 2, 4]])
    key = prefix_key([5, PAD, PAD, 6, PAD, PAD, 7], images, PAD, 2)
    a, b = key[1], key[4]
    assert key == [5, a, a, 6, b, b, 7]
    assert a < 0 and b < 0 and a != b


def test_equal_images_give_equal_keys_and_other_pixels_do_not():
    prompt = [5, PAD, PAD, 6]
    first = prefix_key(prompt, _inputs(["data:a"], [[1, 2, 4]]), PAD, 2)
    again = prefix_key(prompt, _inputs(["data:a"], [[1, 2, 4]]), PAD, 2)
    other = prefix_key(prompt, _inputs(["data:b"], [[1, 2, 4]]), PAD, 2)
    assert first == again
    assert first != other and first[0] == other[0] and first[3] == other[3]
