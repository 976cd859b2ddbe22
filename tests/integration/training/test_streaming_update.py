"""A streamed update (`async_training.streaming_update`): chunks of rows accumulated as their groups finish, then
one optimizer step, give the update of the whole batch at once."""

from __future__ import annotations

import pytest
import torch

from agentrl.config import load_config
from agentrl.training.workers.policy_worker import PolicyWorker
from tests.integration.training.test_policy_worker import BASE, _batch

pytestmark = pytest.mark.slow


def _worker(overrides: list[str] = ()) -> PolicyWorker:
    torch.manual_seed(0)
    return PolicyWorker(load_config(BASE + list(overrides)), total_steps=4, device="cpu")


@pytest.mark.parametrize("chunks", [[[0, 1], [2, 3]], [[2], [0, 3, 1]]], ids=["by-micro-batch", "uneven"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_chunks_accumulated_then_one_step_equal_the_whole_batchs_update(chunks, mode):
    overrides = [f"actor_rollout_ref.actor.loss_agg_mode={mode}", "actor_rollout_ref.actor.grad_clip=0.05"]
    whole, streamed = _worker(overrides), _worker(overrides)
    before = [p.detach().clone() for p in whole.actor.parameters()]
    batch = _batch(whole.tokenizer_pad_id())
    expected = whole.update_actor(batch)
    for rows in chunks:
        streamed.accumulate_actor(batch.select(torch.tensor(rows), trim=True))
    got = streamed.finish_actor_update()
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/entropy"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert expected["actor/grad_norm"] > 0.05  # clipped: the division by the total precedes the clip
    # Adam's first step is lr * g / (|g| + eps): about lr * sign(g) where |g| is well above eps (1e-8), but within
    # a few eps of 0 it turns the gradients' float noise (summed in another order) into a step anywhere in
    # (-lr, lr) (one weight of 2,048 moved 0.00465 in one update and 0.00453 in the other on an AVX2 host). Where the
    # whole batch's step reaches 0.9 lr (|g| >= 9 eps) both updates agree; those below it must be a few (the keys'
    # biases among them: softmax ignores what they add to every key, so their gradients are float noise).
    lr, settled_weights = expected["actor/lr"], 0
    pairs = zip(whole.actor.named_parameters(), streamed.actor.parameters(), before, strict=True)
    for (name, a), b, start in pairs:
        settled = (a - start).abs() >= 0.9 * lr
        settled_weights += int(settled.sum())
        assert torch.allclose(a[settled], b[settled], atol=1e-4, rtol=0), name
    assert settled_weights > 0.9 * sum(start.numel() for start in before)
    # Every weight's gradient, the unsettled ones too: Adam's first moment after one step is (1 - beta1) times the
    # clipped gradient; summed in another order it agrees to ~1e-6 of each tensor's largest.
    moments = zip(
        whole.optimizer.state_dict()["state"].values(),
        streamed.optimizer.state_dict()["state"].values(),
        strict=True,
    )
    for a, b in moments:
        scale = a["exp_avg"].abs().max()
        assert scale > 0
        torch.testing.assert_close(b["exp_avg"], a["exp_avg"], atol=float(scale) * 1e-5, rtol=0)
    assert streamed.optimizer.state_dict()["state"][0]["step"] == 1


def test_finishing_with_nothing_accumulated_is_an_error():
    with pytest.raises(RuntimeError, match="before any accumulate_actor"):
        _worker().finish_actor_update()
