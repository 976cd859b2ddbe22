"""The training loop's heap: objects alive after setup stay out of the cyclic collector until the loop ends."""

from __future__ import annotations

import gc
import weakref

from agentrl.training.heap import setup_objects_frozen


class _Node:
    pass


def test_setup_objects_are_not_collected_while_the_loop_runs_and_are_after():
    node = _Node()
    node.cycle = node  # only the cyclic collector frees it
    alive = weakref.ref(node)
    with setup_objects_frozen() as frozen:
        assert frozen > 1000 and gc.get_freeze_count() > 1000
        del node
        gc.collect()  # a full collection inside the loop does not walk (or free) what setup left
        assert alive() is not None
        made_in_loop = _Node()
        made_in_loop.cycle = made_in_loop
        in_loop = weakref.ref(made_in_loop)
        del made_in_loop
        gc.collect()
        assert in_loop() is None  # the loop's own garbage is collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
