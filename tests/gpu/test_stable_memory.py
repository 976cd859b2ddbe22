"""`StableMemory`: device memory whose addresses survive giving its pages back (run on the device machine)."""

from __future__ import annotations

import pytest
import torch

from agentrl.rollout.engines._stable_memory import StableMemory, unavailable_reason

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)"),
]
MIB = 2**20


def test_released_pages_return_to_the_driver_and_come_back_zeroed_at_the_same_address():
    device = torch.device("cuda", torch.cuda.current_device())
    assert unavailable_reason(device) is None
    memory = StableMemory(256 * MIB + 1, device)
    try:
        assert memory.nbytes >= 256 * MIB + 1
        values = memory.tensor(MIB, 64 * MIB).view(torch.float32)
        assert values.data_ptr() == memory.address + MIB and values.storage_offset() == 0
        assert torch.count_nonzero(values) == 0
        values.fill_(3.0)
        torch.cuda.synchronize()
        free_mapped, _ = torch.cuda.mem_get_info()
        memory.release()
        free_released, _ = torch.cuda.mem_get_info()
        assert free_released - free_mapped >= 256 * MIB
        memory.restore()
        assert memory.tensor(MIB, 64 * MIB).data_ptr() == values.data_ptr()
        assert torch.count_nonzero(values) == 0  # the same tensor reads the fresh pages
        with pytest.raises(ValueError, match="outside"):
            memory.tensor(memory.nbytes - 8, 16)
    finally:
        memory.free()
    assert memory.address is None
