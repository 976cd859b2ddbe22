"""The asynchronous loop's producer: batches in order, never past a boundary, weight pushes between batches."""

import threading
import time

import pytest

from agentrl.training.rollout_pipeline import RolloutPipeline, steps_to_request


def test_requests_reach_the_staleness_bound_but_stop_at_a_boundary():
    never = lambda step: False  # noqa: E731
    assert steps_to_request(1, 10, 1, never) == [2]
    assert steps_to_request(1, 10, 3, never) == [2, 3, 4]
    assert steps_to_request(9, 10, 3, never) == [10]
    saves_at_4 = lambda step: step == 4  # noqa: E731
    assert steps_to_request(2, 10, 3, saves_at_4) == [3, 4]  # 5 would be in flight at the save after step 4
    assert steps_to_request(4, 10, 3, saves_at_4) == []  # step 4 itself saves: nothing may run past it
    assert steps_to_request(5, 10, 0, never) == []


def test_batches_come_back_in_order_and_errors_reach_take():
    counter = iter(range(100))

    def collect():
        value = next(counter)
        if value == 2:
            raise ValueError("rollout failed")
        return value

    pipeline = RolloutPipeline(collect, partial_rollout=True)
    for _ in range(4):
        pipeline.request()
    assert [pipeline.take(), pipeline.take()] == [0, 1]
    with pytest.raises(ValueError, match="rollout failed"):
        pipeline.take()
    assert pipeline.take() == 3 and pipeline.scheduled == 0
    pipeline.close()


def test_without_partial_rollouts_a_weight_push_waits_for_the_batch_in_collection():
    started, release = threading.Event(), threading.Event()

    def collect():
        started.set()
        release.wait(5)
        return "batch"

    pipeline = RolloutPipeline(collect, partial_rollout=False)
    pipeline.request()
    started.wait(5)
    pushed_at = []
    pusher = threading.Thread(target=lambda: pushed_at.append(pipeline.push_weights(time.monotonic)))
    pusher.start()
    time.sleep(0.2)
    assert not pushed_at  # still collecting: the push waits
    released_at = time.monotonic()
    release.set()
    pusher.join(5)
    assert pushed_at and pushed_at[0] >= released_at
    assert pipeline.take() == "batch"
    pipeline.close()
