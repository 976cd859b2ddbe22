"""The engine's pinned staging ring: every copy arrives intact while earlier ones are still queued, however many
times the ring wraps, and a copy too large for a buffer still goes through."""

from __future__ import annotations

import pytest
import torch

from agentrl.rollout.engines._staging import BUFFER_BYTES, RING_BUFFERS, PinnedStaging

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)"),
]


def test_copies_through_the_ring_arrive_intact_behind_queued_work():
    staging = PinnedStaging(torch.device("cuda"))
    busy = torch.randn(4096, 4096, device="cuda")
    sent, arrived = [], []
    for i in range(3 * RING_BUFFERS + 5):
        if i % 50 == 0:
            busy = busy @ busy  # keep the stream busy so copies queue behind it
            busy /= busy.norm()
        values = torch.arange(i, i + 1 + i % 300, dtype=torch.long if i % 2 else torch.float32)
        sent.append(values.clone())
        arrived.append(staging.to_device(values) * 1)  # a kernel reading the copy, queued too
    back = [staging.to_host(t) for t in arrived[-RING_BUFFERS:]]
    torch.cuda.synchronize()
    for s, a in zip(sent, arrived, strict=True):
        assert torch.equal(a.cpu(), s)
    for (host, done), s in zip(back, sent[-RING_BUFFERS:], strict=True):
        assert done.query() and torch.equal(host, s)
    large = torch.arange(BUFFER_BYTES, dtype=torch.long)  # 8x a buffer
    assert torch.equal(staging.to_device(large).cpu(), large)
