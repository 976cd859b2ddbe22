"""Where an engine's own weights wait while it sleeps: pinned host buffers, then back to the same device addresses.

An engine that owns its weights (a serving copy beside the trainer: LoRA, or a trainer that is not the engine's
module) moves them to the host while the hybrid engine sleeps. Brought back by the allocator they land at new
addresses, and every CUDA graph, which reads its weights by address, must be captured again after each update.
Under CUDA graphs they come back into `StableMemory` instead: the same addresses at every wake from the second
one on, so the graphs captured after the first update replay the updated weights.
"""

from __future__ import annotations

import torch

from agentrl.rollout.engines._stable_memory import StableMemory, stable_memory

ALIGNMENT = 512
"""Bytes each weight's place in the stable memory is aligned to (what kernels assume of a fresh allocation)."""


def weight_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers, each tied tensor once."""
    seen: set[int] = set()
    tensors = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append((name, tensor))
    return tensors


class ParkedWeights:
    """Moves `model`'s weights to pinned host buffers (`park`) and back (`restore`). `stable`: bring them back
    to fixed addresses (`StableMemory`, reserved at the first park) when the driver offers it."""

    def __init__(self, model: torch.nn.Module, device: torch.device, stable: bool) -> None:
        self.model = model
        self.device = device
        self.stable = stable
        self._host: dict[str, torch.Tensor] | None = None
        self._memory: StableMemory | None = None
        self._places: dict[str, torch.Tensor] = {}
        """Each weight's device tensor in `_memory` (zeroed pages until `restore` copies it back)."""
        self.discarded: set[str] = set()
        """Parameters `park(keep=False)` left behind: their device tensors hold nothing until a push loads them."""

    def park(self, keep: bool = True) -> None:
        """Copy the weights into pinned host buffers (kept across sleeps) and free their device memory.

        `model.to("cpu")` copied into fresh pageable memory every time: ~1 s a step for a 0.5B model under
        LoRA, whose engine owns a copy; pinned buffers copy at the bus's speed. `keep=False`: the caller loads
        every parameter again before the engine generates (the synchronous step's sync rewrites them all), so
        parameters are not copied out, nor back at `restore` (buffers still are); `discarded` names them."""
        tensors = weight_tensors(self.model)
        if self._host is None:
            self._host = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for name, t in tensors}
        parameters = {id(p) for p in self.model.parameters()}
        self.discarded = set() if keep else {name for name, t in tensors if id(t) in parameters}
        for name, tensor in tensors:
            if name not in self.discarded:
                self._host[name].copy_(tensor.data, non_blocking=True)
        torch.cuda.synchronize(self.device)
        for name, tensor in tensors:
            tensor.data = self._host[name]
        if self.stable and self._memory is None:
            torch.cuda.empty_cache()  # the weights' old memory, for the reservation's first pages
            self._reserve(tensors)
        if self._memory is not None:
            self._memory.release()

    def settle(self) -> None:
        """Move the weights to the places every wake brings them back to, before any graph reads them: parked
        and restored once, through the host (a copy on the device would need the weights' memory twice)."""
        if self.stable:
            self.park()
            self.restore()

    def restore(self) -> None:
        """Bring the weights back to the device: into their stable places when reserved, else wherever the
        allocator puts them."""
        if self._memory is not None:
            self._memory.restore()
        for name, tensor in weight_tensors(self.model):
            if tensor.device.type != "cpu":
                continue
            place = self._places.get(name)
            if name in self.discarded:  # a push fills it
                tensor.data = torch.empty_like(tensor.data, device=self.device) if place is None else place
            elif place is None:
                tensor.data = tensor.data.to(self.device, non_blocking=True)
            else:
                place.copy_(tensor.data, non_blocking=True)
                tensor.data = place
        torch.cuda.synchronize(self.device)

    def loaded(self, names: set[str]) -> None:
        """A push wrote these weights (`model.state_dict()` names, tied ones through either name). Raises
        naming the discarded parameters it left out: they hold nothing, and the engine must not serve them."""
        if not self.discarded:
            return
        state = self.model.state_dict()
        written = {state[name].data_ptr() for name in names if name in state}
        self.discarded = {
            name
            for name, t in weight_tensors(self.model)
            if name in self.discarded and t.data_ptr() not in written
        }
        if self.discarded:
            raise RuntimeError(
                f"the engine slept with discard_weights=True and this push did not load "
                f"{len(self.discarded)} of its weights ({', '.join(sorted(self.discarded)[:5])}, ...): it keeps "
                f"waiting for a push of every weight before it generates"
            )

    def _reserve(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        offsets, end = {}, 0
        for name, tensor in tensors:
            offsets[name] = end
            end += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
        self._memory = stable_memory(end, self.device, "an engine's own weights")
        if self._memory is None:
            self.stable = False
            return
        self._places = {
            name: self._memory.tensor(offsets[name], t.numel() * t.element_size()).view(t.dtype).view(t.shape)
            for name, t in tensors
        }
