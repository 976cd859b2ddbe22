"""Copies of the engine's small per-step tensors between host and device, through pinned buffers allocated once.

Each decode step sends a few short lists to the GPU (retired slots, positions, sampling settings). A copy
from pageable memory waits for every kernel queued before it; `tensor.pin_memory()` avoids that wait but asks
PyTorch's pinned-memory allocator for a fresh block each time, whose bookkeeping and occasional
`cudaHostAlloc` cost milliseconds while a decode step takes two: a py-spy profile of the 8-turn agent
workload on an H100 found a third of the engine thread's busy time in that call. A ring of pinned buffers,
each reused only after the copy out of it has completed (a CUDA event), costs a memcpy into host memory. Each
step's draws come back the same way (`to_host`).
"""

from __future__ import annotations

import torch

RING_BUFFERS = 128
"""Buffers in the ring: more than the copies one engine step makes while the device runs a step behind."""
BUFFER_BYTES = 1 << 16
"""Largest copy a buffer takes (an extend step's 128 x 64 token ids); a larger one is pinned on its own."""


class _PinnedRing:
    """Pinned buffers used in turn; a buffer is handed out again only once the copy recorded on it is done."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = [None] * RING_BUFFERS
        self._next = 0

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """A pinned tensor of `like`'s shape and dtype and its index (for `copied`); None if it is too large."""
        size = like.numel() * like.element_size()
        if size > BUFFER_BYTES:
            return None
        if not self._buffers:
            self._buffers = [
                torch.empty(BUFFER_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(RING_BUFFERS)
            ]
        i, self._next = self._next, (self._next + 1) % RING_BUFFERS
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # its copy, RING_BUFFERS copies ago, has finished
        return self._buffers[i][:size].view(like.dtype).view(like.shape), i

    def copied(self, i: int) -> torch.cuda.Event:
        """Record that a copy into or out of buffer `i` was queued on the current stream; its event."""
        done = torch.cuda.Event()
        done.record()
        self._copied[i] = done
        return done


class PinnedStaging:
    """Asynchronous copies of small tensors between the host and `device` through reused pinned buffers.

    A host copy of a device tensor (`to_host`) stays valid until RING_BUFFERS later copies: the engine reads
    each step's draws one or two steps later."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._inbound = _PinnedRing()
        self._outbound = _PinnedRing()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """`host` (a CPU tensor) on the device; the copy is queued on the current stream, nothing waits."""
        host = host.contiguous()
        taken = self._inbound.take(host)
        if taken is None:
            return host.pin_memory().to(self.device, non_blocking=True)
        staged, i = taken
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        self._inbound.copied(i)
        return out

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned host tensor that `tensor` is being copied into, and the event that marks the copy done."""
        taken = self._outbound.take(tensor)
        if taken is None:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return host, done
        host, i = taken
        host.copy_(tensor, non_blocking=True)
        return host, self._outbound.copied(i)
