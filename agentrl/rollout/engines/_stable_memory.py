"""Device memory at addresses that outlive its pages, through CUDA's virtual memory management.

The hybrid engine's sleep gives the KV cache's memory to training. Freed through PyTorch's allocator, the cache
comes back elsewhere, and every CUDA graph that reads it by address must be captured again: 1-4 s of every
8-turn agent step on an H100 (docs/benchmarks.md). Here the cache's virtual address range is reserved once;
`release` unmaps and frees its physical pages (the driver's free memory grows by all of it) and `restore` maps
fresh pages at the same addresses, so the graphs replay as they are. vLLM's sleep mode keeps its cache the same
way. The driver library is called through ctypes: no compiled extension to build.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

logger = logging.getLogger(__name__)

_SUCCESS = 0
_OUT_OF_MEMORY = 2
_ALLOCATION_PINNED = 1
_LOCATION_DEVICE = 1
_ACCESS_READ_WRITE = 3
_ATTRIBUTE_VMM_SUPPORTED = 102
_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compression_type", ctypes.c_ubyte),
        ("gpu_direct_rdma_capable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    """CUmemAllocationProp."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requested_handle_types", ctypes.c_int),
        ("location", _Location),
        ("win32_handle_meta_data", ctypes.c_void_p),
        ("alloc_flags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    """CUmemAccessDesc."""

    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _DeviceArray:
    """What `torch.as_tensor` reads a device pointer from (the CUDA array interface); owns nothing."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


_DRIVER: ctypes.CDLL | None = None
_UNAVAILABLE: str | None = None
_SAID: set[str] = set()


def _driver() -> ctypes.CDLL:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = ctypes.CDLL("libcuda.so.1")
    return _DRIVER


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; `code` is its CUresult."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"CUDA driver call {call} failed with CUresult {code}")
        self.code = code


def _check(call: str, *args: object) -> None:
    code = getattr(_driver(), call)(*args)
    if code != _SUCCESS:
        raise CudaDriverError(call, code)


def _ordinal(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _device_handle(device: torch.device) -> ctypes.c_int:
    handle = ctypes.c_int()
    _check("cuDeviceGet", ctypes.byref(handle), ctypes.c_int(_ordinal(device)))
    return handle


def unavailable_reason(device: torch.device) -> str | None:
    """Why stable memory cannot be had on `device` (None: it can). Checked once per process; `AGENTRL_STABLE_MEMORY=0`
    turns it off (the cache and an engine's own weights are then freed at each sleep, as before it existed)."""
    global _UNAVAILABLE
    if _UNAVAILABLE is None and os.environ.get("AGENTRL_STABLE_MEMORY", "1") == "0":
        _UNAVAILABLE = "turned off by AGENTRL_STABLE_MEMORY=0"
    if _UNAVAILABLE is None:
        try:
            torch.cuda.synchronize(device)  # the primary context, current on this thread
            supported = ctypes.c_int()
            _check(
                "cuDeviceGetAttribute",
                ctypes.byref(supported),
                ctypes.c_int(_ATTRIBUTE_VMM_SUPPORTED),
                _device_handle(device),
            )
            _UNAVAILABLE = "" if supported.value else "the GPU or its driver lacks virtual memory management"
        except (OSError, AttributeError, CudaDriverError) as error:
            _UNAVAILABLE = f"the CUDA driver's virtual memory calls failed: {error}"
    return _UNAVAILABLE or None


def stable_memory(nbytes: int, device: torch.device, what: str) -> StableMemory | None:
    """`StableMemory` of `nbytes` for `what`, or None (said once, at INFO) where the driver does not offer it or
    refuses it: the caller then allocates as usual and its graphs are captured again after each sleep."""
    global _UNAVAILABLE
    reason = unavailable_reason(device)
    if reason is None:
        try:
            return StableMemory(nbytes, device, what)
        except CudaDriverError as error:
            reason = _UNAVAILABLE = f"the CUDA driver refused it: {error}"
    if what not in _SAID:
        _SAID.add(what)
        logger.info(
            "embedded engine: no stable addresses for %s, so CUDA graphs are captured again after each sleep: %s",
            what,
            reason,
        )
    return None


class StableMemory:
    """`nbytes` (rounded up to the driver's granularity) of memory on a CUDA device whose addresses survive
    `release` and `restore`. Tensors over it (`tensor`) hold no reference to the pages: keep this object while
    they are used, and `free` it only once nothing queued on the device reads them."""

    def __init__(self, nbytes: int, device: torch.device, what: str = "the KV cache") -> None:
        if reason := unavailable_reason(device):
            raise RuntimeError(reason)
        self.device = device
        self.what = what
        self._prop = _AllocationProp(
            type=_ALLOCATION_PINNED, location=_Location(type=_LOCATION_DEVICE, id=_ordinal(device))
        )
        granularity = ctypes.c_size_t()
        _check(
            "cuMemGetAllocationGranularity",
            ctypes.byref(granularity),
            ctypes.byref(self._prop),
            ctypes.c_int(_GRANULARITY_MINIMUM),
        )
        self.nbytes = -(-nbytes // granularity.value) * granularity.value
        address = ctypes.c_uint64()
        _check(
            "cuMemAddressReserve",
            ctypes.byref(address),
            ctypes.c_size_t(self.nbytes),
            ctypes.c_size_t(0),
            ctypes.c_uint64(0),
            ctypes.c_uint64(0),
        )
        self.address = address.value
        self._pages: ctypes.c_uint64 | None = None
        try:
            self.restore()
        except BaseException:
            _check("cuMemAddressFree", ctypes.c_uint64(self.address), ctypes.c_size_t(self.nbytes))
            raise

    @property
    def mapped(self) -> bool:
        return self._pages is not None

    def tensor(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """`nbytes` of the memory from byte `offset` (default: all of it) as a uint8 tensor of its own (storage
        offset 0: view it as the dtype and shape wanted)."""
        nbytes = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"bytes {offset}..{offset + nbytes} lie outside the {self.nbytes} reserved")
        return torch.as_tensor(_DeviceArray(self.address + offset, nbytes), device=self.device)

    def restore(self) -> None:
        """Map fresh physical pages at the reserved addresses and zero them. A driver out of memory is asked
        again once PyTorch's allocator has returned what it caches."""
        if self._pages is not None:
            return
        torch.cuda.synchronize(self.device)
        pages = ctypes.c_uint64()
        size = ctypes.c_size_t(self.nbytes)
        try:
            _check("cuMemCreate", ctypes.byref(pages), size, ctypes.byref(self._prop), ctypes.c_uint64(0))
        except CudaDriverError as error:
            if error.code != _OUT_OF_MEMORY:
                raise
            torch.cuda.empty_cache()
            try:
                _check("cuMemCreate", ctypes.byref(pages), size, ctypes.byref(self._prop), ctypes.c_uint64(0))
            except CudaDriverError as again:
                free, _ = torch.cuda.mem_get_info(self.device)
                raise RuntimeError(
                    f"the embedded engine could not get back the {self.nbytes / 2**30:.2f} GiB of {self.what} after "
                    f"a sleep ({free / 2**30:.2f} GiB free on {self.device}): the trainer holds the rest. A smaller KV "
                    "cache: lower actor_rollout_ref.rollout.max_num_seqs or data.max_response_length; no fused "
                    "weights: actor_rollout_ref.rollout.fuse_projections=false"
                ) from again
        address = ctypes.c_uint64(self.address)
        try:
            _check("cuMemMap", address, size, ctypes.c_size_t(0), pages, ctypes.c_uint64(0))
            access = _AccessDesc(location=self._prop.location, flags=_ACCESS_READ_WRITE)
            _check("cuMemSetAccess", address, size, ctypes.byref(access), ctypes.c_size_t(1))
        except BaseException:
            _check("cuMemRelease", pages)
            raise
        self._pages = pages
        self.tensor().zero_()

    def release(self) -> None:
        """Give the physical pages back to the driver, keeping the addresses (once the device is done)."""
        if self._pages is None:
            return
        torch.cuda.synchronize(self.device)
        _check("cuMemUnmap", ctypes.c_uint64(self.address), ctypes.c_size_t(self.nbytes))
        _check("cuMemRelease", self._pages)
        self._pages = None

    def free(self) -> None:
        """Release the pages and the addresses; no tensor over them may be used afterwards."""
        if self.address is None:
            return
        self.release()
        _check("cuMemAddressFree", ctypes.c_uint64(self.address), ctypes.c_size_t(self.nbytes))
        self.address = None
