"""The Python heap during the training loop: what setup built is left out of the cyclic collector's scans.

A full (generation 2) collection walks every tracked object. After setup a trainer holds ~0.5M of them (the
model's modules and parameters, peft's adapter modules, the tokenizer, the servers), and each step allocates
enough (episodes, traces, autograd's tensors) to trigger one now and then: 0.29 s on this 2-core host inside
a 4-step LoRA run of the 0.5B shape, a pause that lands in whichever step it hits. Freezing the heap after
setup (`gc.freeze`, as vLLM's engine does after start-up) leaves only the loop's own objects to scan; the
heap is unfrozen when the loop ends, so a process that trains several times (tests, notebooks) collects it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def setup_objects_frozen() -> Iterator[int]:
    """Collect once, then freeze every object alive (yields how many) until the block ends."""
    gc.collect()
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()
