"""Keep Python's full garbage collections off the training steps.

A training process holds about half a million container objects once it is set up (modules, the tokenizer,
the engine, the gateway, compiled code). CPython's full (generation 2) collection walks all of them, and it runs
whenever enough new objects have survived, wherever that happens: inside a reference forward or an update, where
the device waits for the next kernel launch. On 2 CPU cores one such pass took 0.34 s during a 6-step run of the
tiny model (`gc.callbacks`, twenty-ninth session). What setup built lives for the whole run, so it is collected
once and then frozen out of every later collection (`gc.freeze`): the passes during training walk only what the
steps made (~70k objects there), and none of them reached generation 2 in the same run.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_setup_objects() -> int:
    """Collect what setup left behind, then move every surviving object into the permanent generation that
    collections skip; returns how many objects are frozen. Call once setup is done: an object frozen here that
    later becomes part of a garbage cycle is not collected until `thaw_setup_objects`."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("garbage collector: %d objects built during setup frozen out of later collections", frozen)
    return frozen


def thaw_setup_objects() -> None:
    """At the end of a run: frozen objects go back to the oldest generation, so a process that trains again
    (a notebook, a sweep, the test suite) collects what the finished run left in cycles."""
    gc.unfreeze()
