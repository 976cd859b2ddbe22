"""The left-padded batch: rows that join (merge) and leave (select) decode exactly as alone."""

import pytest
import torch

from agentrl.rollout.engines._batch import decode, merge, prefill, select_rows
from tests._random_qwen2 import random_qwen2


@pytest.fixture(scope="module")
def model():
    return random_qwen2(vocab_size=50)


def _alone(model, tokens):
    """Next-token logits of an unpadded forward over `tokens` (the reference)."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def test_prefill_left_pads_and_matches_unpadded(model):
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    batch, logits = prefill(model, prompts)
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert batch.positions.tolist() == [5, 2]
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], _alone(model, prompt), atol=1e-5, rtol=0)


def test_merge_decode_select_match_unpadded(model):
    first, _ = prefill(model, [[1, 2, 3], [4, 5, 6, 7, 8, 9]])
    logits_a = decode(model, first, [10, 11])  # both rows one token further
    second, _ = prefill(model, [[12, 13]])
    batch = merge(first, second)
    assert batch.size == 3 and batch.slots == 7
    logits = decode(model, batch, [20, 21, 22])
    torch.testing.assert_close(logits_a[0], _alone(model, [1, 2, 3, 10]), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[0], _alone(model, [1, 2, 3, 10, 20]), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1], _alone(model, [4, 5, 6, 7, 8, 9, 11, 21]), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[2], _alone(model, [12, 13, 22]), atol=1e-5, rtol=0)

    kept = select_rows(batch, [2, 0])  # the long row leaves: shared padding is trimmed away
    assert kept.size == 2 and kept.slots == 5
    assert kept.positions.tolist() == [3, 5]
    logits = decode(model, kept, [30, 31])
    torch.testing.assert_close(logits[0], _alone(model, [12, 13, 22, 30]), atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1], _alone(model, [1, 2, 3, 10, 20, 31]), atol=1e-5, rtol=0)
    assert select_rows(kept, []) is None
