"""`SlotBatch.compile_now`: the decode step is traced before the first request with inputs like the ones decoding
passes, so the first real decode runs the compiled step instead of compiling it again (a second ~60-80 s
compile on an H100 host, inside the first rollout)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from agentrl.rollout.engines._slot_batch import SlotBatch
from agentrl.rollout.engines._slot_decode import decode_step


def test_compile_now_traces_what_decoding_runs_so_nothing_compiles_again(model):
    """Dynamo's eager backend stands in for Inductor (the same tracing and guards, no code generation): the
    compiled step is traced once at `compile_now` and never again, for a longer cache and another bucket."""
    torch._dynamo.reset()
    counters.clear()
    batch = SlotBatch(model, max_slots=16, max_model_len=1024, cuda_graphs=False)
    batch._decode_step = torch.compile(decode_step.__wrapped__, dynamic=True, backend="eager")
    assert batch.compile_now() > 0
    assert batch.length == 0  # the cache it traced with is freed again
    traced = counters["stats"]["unique_graphs"]
    assert traced == 1
    prompts = [[5, 6, 7, 8], [9, 10]]
    batch.admit(prompts, [3, 2], reserve=300)  # a 512-position cache, 5 rows: bucket 8
    for _ in range(3):
        batch.decode([11] * batch.size)
    batch.admit([[12, 13, 14]], [6], reserve=300)  # 11 rows: bucket 16
    batch.decode([15] * batch.size)
    assert counters["stats"]["unique_graphs"] == traced
