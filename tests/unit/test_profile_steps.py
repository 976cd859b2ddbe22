"""`benchmarks/profile_steps.py`'s stack sampler: a thread that waits somewhere shows there in the report of its
slowest update, with that update's phases."""

import threading
import time

from benchmarks.profile_steps import StackSampler, stall_report


def _waits_here() -> None:
    time.sleep(0.3)


def test_the_slowest_update_shows_where_its_thread_waited():
    sampler = StackSampler(threading.get_ident(), 0.005)
    try:
        start = time.perf_counter()
        _waits_here()
        end = time.perf_counter()
        time.sleep(0.05)  # samples after the window are left out
    finally:
        sampler.stop()
    quick = (4, end + 0.01, end + 0.02, {"timing/update_actor": 0.01})
    timing = {"timing/update_actor": end - start, "timing/adv": 0.001}
    report = stall_report(sampler, [(1, start, end, timing), (3, start, end, timing), quick], slowest=1)
    lines = report.splitlines()
    assert lines[0].startswith("=== step 3: update 0.3")  # step 1 is warm-up and left out
    assert '"timing/update_actor"' in lines[0] and "timing/adv" not in lines[0]
    count, chain = lines[1].split(maxsplit=1)
    assert "_waits_here" in chain and int(count) >= 20
    assert any(line.startswith("=== step 4") for line in lines)  # the median update, for comparison
