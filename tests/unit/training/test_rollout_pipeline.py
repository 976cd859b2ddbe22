"""The asynchronous loop's producer: batches in order, never past a boundary, weight pushes between batches."""

import asyncio
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

    async def collect():
        value = next(counter)
        await asyncio.sleep(0.01 * (3 - value % 4))  # later batches end first
        if value == 2:
            raise ValueError("rollout failed")
        return value

    pipeline = RolloutPipeline(collect, partial_rollout=True, concurrent=4)
    for _ in range(4):
        pipeline.request()
    assert [pipeline.take(), pipeline.take()] == [0, 1]
    with pytest.raises(ValueError, match="rollout failed"):
        pipeline.take()
    assert pipeline.take() == 3 and pipeline.scheduled == 0
    pipeline.close()


def _overlap_probe(pipeline_kwargs: dict) -> list[str]:
    """What happened, in order, when two batches were asked for: the first waits up to 1 s for the second to
    start (it can only when batches overlap)."""
    events: list[str] = []
    second_started = asyncio.Event()
    counter = iter(range(2))

    async def collect():
        index = next(counter)  # drawn before the first await: in the order asked
        events.append(f"start {index}")
        if index == 0:
            try:
                await asyncio.wait_for(second_started.wait(), 1.0)
            except asyncio.TimeoutError:
                events.append("0 waited alone")
        else:
            second_started.set()
        events.append(f"end {index}")
        return index

    pipeline = RolloutPipeline(collect, **pipeline_kwargs)
    pipeline.request()
    pipeline.request()
    assert [pipeline.take(), pipeline.take()] == [0, 1]
    pipeline.close()
    return events


def test_batches_asked_for_together_are_collected_at_once_and_started_in_order():
    events = _overlap_probe({"partial_rollout": True, "concurrent": 2})
    assert events == ["start 0", "start 1", "end 1", "end 0"]


def test_one_batch_at_a_time_starts_the_next_only_when_the_last_ended():
    events = _overlap_probe({"partial_rollout": True, "concurrent": 1})
    assert events == ["start 0", "0 waited alone", "end 0", "start 1", "end 1"]
    with pytest.raises(ValueError, match="partial rollouts"):
        RolloutPipeline(lambda: None, partial_rollout=False, concurrent=2)


def test_without_partial_rollouts_a_weight_push_waits_for_the_batch_in_collection():
    started, release = threading.Event(), threading.Event()

    async def collect():
        started.set()
        await asyncio.to_thread(release.wait, 5)
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


def test_close_cancels_batches_not_started_and_waits_for_the_one_running():
    release = threading.Event()
    ran: list[int] = []
    counter = iter(range(3))

    async def collect():
        index = next(counter)
        ran.append(index)
        await asyncio.to_thread(release.wait, 5)
        return index

    pipeline = RolloutPipeline(collect, partial_rollout=True, concurrent=1)
    for _ in range(3):
        pipeline.request()
    time.sleep(0.1)
    threading.Timer(0.2, release.set).start()
    pipeline.close(wait_s=5)
    assert ran == [0]  # batches 1 and 2 never started
    with pytest.raises(RuntimeError, match="closed"):
        pipeline.request()
