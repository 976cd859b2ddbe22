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


def _pipeline(collect, *, partial_rollout: bool) -> tuple[RolloutPipeline, asyncio.Runner]:
    runner = asyncio.Runner()
    return RolloutPipeline(collect, runner.get_loop(), partial_rollout=partial_rollout), runner


def test_batches_come_back_in_order_and_errors_reach_take():
    counter = iter(range(100))

    async def collect(_on_part):
        value = next(counter)
        await asyncio.sleep(0.05 * (4 - value))  # later batches finish first
        if value == 2:
            raise ValueError("rollout failed")
        return value

    pipeline, runner = _pipeline(collect, partial_rollout=True)
    for _ in range(4):
        pipeline.request()
    assert [pipeline.take(), pipeline.take()] == [0, 1]
    with pytest.raises(ValueError, match="rollout failed"):
        pipeline.take()
    assert pipeline.take() == 3 and pipeline.scheduled == 0
    pipeline.close()
    runner.close()


@pytest.mark.parametrize("partial_rollout", [True, False])
def test_with_partial_rollouts_a_batch_starts_while_the_one_before_is_still_collected(partial_rollout):
    """The slow end of one batch overlaps the next: batch 1 is collected whole while batch 0 still waits (on a
    slow tool, say); without partial rollouts batch 1 starts only after batch 0 ends."""
    release, events, index = threading.Event(), [], iter(range(2))

    async def collect(_on_part):
        i = next(index)
        events.append(f"start {i}")
        while i == 0 and not release.is_set():
            await asyncio.sleep(0.01)
        events.append(f"end {i}")
        return i

    pipeline, runner = _pipeline(collect, partial_rollout=partial_rollout)
    pipeline.request()
    pipeline.request()
    time.sleep(0.3)
    release.set()
    assert [pipeline.take(), pipeline.take()] == [0, 1]
    overlapped = ["start 0", "start 1", "end 1", "end 0"]
    assert events == (overlapped if partial_rollout else ["start 0", "end 0", "start 1", "end 1"])
    pipeline.close()
    runner.close()


def test_other_coroutines_reach_the_loop_through_the_pipeline_and_the_runner_gets_it_back_at_close():
    async def collect(_on_part):
        await asyncio.sleep(0.2)
        return "batch"

    async def loop_id():
        return id(asyncio.get_running_loop())

    pipeline, runner = _pipeline(collect, partial_rollout=True)
    pipeline.request()
    assert pipeline.run(loop_id()) == id(runner.get_loop())  # beside the batch in collection
    assert pipeline.take() == "batch"
    pipeline.close()
    assert runner.run(loop_id()) == id(runner.get_loop())
    runner.close()


def test_without_partial_rollouts_a_weight_push_waits_for_the_batch_in_collection():
    started, release = threading.Event(), threading.Event()

    async def collect(_on_part):
        started.set()
        while not release.is_set():
            await asyncio.sleep(0.01)
        return "batch"

    pipeline, runner = _pipeline(collect, partial_rollout=False)
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
    runner.close()


def test_each_batch_taken_reports_its_collection_time_and_its_head_start():
    """`async/batch_collect_s` is the batch's own collection (0.3 s here), `async/batch_head_start_s` how long it
    had run when `take` was called: the second batch, asked for with the first, had a 0.2 s head start more."""

    async def collect(_on_part):
        await asyncio.sleep(0.3)
        return "batch"

    pipeline, runner = _pipeline(collect, partial_rollout=True)
    pipeline.request()
    pipeline.request()
    time.sleep(0.11)  # a collection starts a moment after `request` returns: 10 ms spare for it
    pipeline.take()
    first = pipeline.last_batch_timing
    time.sleep(0.21)
    pipeline.take()
    second = pipeline.last_batch_timing
    assert 0.3 <= first["async/batch_collect_s"] < 0.6 and 0.3 <= second["async/batch_collect_s"] < 0.6
    assert 0.1 <= first["async/batch_head_start_s"] < first["async/batch_collect_s"]
    assert second["async/batch_head_start_s"] >= 0.5  # taken after the first's 0.3 s and 0.2 s more
    assert (
        second["async/batch_head_start_s"] > second["async/batch_collect_s"]
    )  # it was whole before asked for
    pipeline.close()
    runner.close()


def test_parts_of_the_oldest_batch_come_as_they_are_handed_over_and_end_with_it():
    """A streamed update reads a batch's groups while the batch is still collected: each part as it comes, the
    next batch's parts not mixed in, and the end of the batch (done or failed) ends the parts."""
    release = threading.Event()
    index = iter(range(2))

    async def collect(on_part):
        i = next(index)
        on_part(f"{i}a")
        while not release.is_set():
            await asyncio.sleep(0.01)
        on_part(f"{i}b")
        if i == 1:
            raise ValueError("batch 1 failed")
        return i

    pipeline, runner = _pipeline(collect, partial_rollout=True)
    pipeline.request()
    pipeline.request()
    parts = pipeline.parts()
    first_at, first = next(parts)
    assert first == "0a"  # before the batch is done
    release.set()
    [(second_at, second)] = list(parts)
    assert second == "0b" and first_at < second_at and list(pipeline.parts()) == []
    assert pipeline.take() == 0
    assert [part for _, part in pipeline.parts()] == ["1a", "1b"]
    with pytest.raises(ValueError, match="batch 1 failed"):
        pipeline.take()
    pipeline.close()
    runner.close()
