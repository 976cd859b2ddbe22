"""`release_openmp_workers`: the calling thread's OpenMP pool ends (its worker threads exit), other threads' pools
stay, and the next parallel region makes a new one."""

import os
import threading

import torch

from agentrl.rollout.engines._openmp import release_openmp_workers


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> None:
    # far above ATen's grain size: one parallel region on every torch thread
    torch.ones(4_000_000).mul_(2).sum()


def test_the_calling_threads_workers_exit_and_come_back_on_the_next_parallel_region():
    counts: dict[str, int] = {}
    other_ready, other_done = threading.Event(), threading.Event()

    def other() -> None:  # a thread with a pool of its own, which must survive the release
        torch.set_num_threads(3)
        _parallel_work()
        other_ready.set()
        other_done.wait()

    def caller() -> None:
        torch.set_num_threads(3)
        _parallel_work()
        counts["with both pools"] = _threads()
        counts["released"] = release_openmp_workers()
        counts["after release"] = _threads()
        _parallel_work()
        counts["after new work"] = _threads()

    keeper = threading.Thread(target=other)
    keeper.start()
    other_ready.wait()
    worker = threading.Thread(target=caller)
    worker.start()
    worker.join()
    other_done.set()
    keeper.join()
    assert counts["released"] is True
    # the caller's two workers, not the other's
    assert counts["after release"] == counts["with both pools"] - 2
    assert counts["after new work"] == counts["with both pools"]
