"""CUDA graph launches and device timing marks that keep the GIL.

torch's `CUDAGraph.replay` lets go of the GIL while it launches. In the trainer's process the agents' Python
keeps the event loop's thread busy, so the engine's thread, having let go, may wait for the GIL to come back (up
to `sys.getswitchinterval()`, 5 ms) before it can go on. On the 8-turn agent benchmark (H200, 0.5B shape) 70 of
221 prefill replays and 98 of 393 decode replays took over 1 ms of the engine thread's time (at most 7 ms) for a
launch that takes ~5 us, and a prefill forward's end mark, recorded once the replay had the GIL back, counted
that wait as the forward's device time (docs/benchmarks.md, "Graph launches that keep the GIL").

Here a graph is launched through the CUDA driver (`cuGraphLaunch`) and the timing events are recorded through it
(`cuEventRecord`), both called through `ctypes.PyDLL`, which keeps the GIL: a forward's start mark, its launch
and its end mark follow one another without the GIL changing hands.

A graph whose first replay moved torch's CUDA generator draws torch random numbers, whose offsets only torch's
replay sets: it keeps torch's replay. The engine's own sampling draws from counters (`uniform_draws`), so its
graphs take the driver's path. Without the driver library (not CUDA) everything goes through torch.
"""

from __future__ import annotations

import ctypes
import weakref
from collections import deque

import torch


def _driver() -> ctypes.PyDLL | None:
    try:
        lib = ctypes.PyDLL("libcuda.so.1")
    except OSError:
        return None
    for name in ("cuGraphLaunch", "cuEventRecord"):
        function = getattr(lib, name)
        function.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        function.restype = ctypes.c_int
    return lib


class GraphLauncher:
    """Launch CUDA graphs and record timing events on the current stream of `device` without letting go of the
    GIL (see the module docstring); through torch's calls where the CUDA driver library is not there (ROCm)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._driver = _driver() if torch.version.hip is None else None
        self._direct: weakref.WeakKeyDictionary[torch.cuda.CUDAGraph, bool] = weakref.WeakKeyDictionary()
        self._free: deque[torch.cuda.Event] = deque()

    @property
    def through_driver(self) -> bool:
        return self._driver is not None

    def launch(self, graph: torch.cuda.CUDAGraph) -> None:
        """Replay `graph` on the current stream."""
        direct = self._direct.get(graph)
        if direct is None:  # first launch: through torch, to see whether it draws torch random numbers
            generator = torch.cuda.default_generators[self._index()]
            offset = generator.get_offset()
            graph.replay()
            self._direct[graph] = self._driver is not None and generator.get_offset() == offset
        elif direct:
            self._check(
                self._driver.cuGraphLaunch(graph.raw_cuda_graph_exec(), self._stream()), "cuGraphLaunch"
            )
        else:
            graph.replay()

    def mark(self) -> torch.cuda.Event:
        """A timing event recorded now on the current stream; give it back with `release` once read."""
        event = self._free.pop() if self._free else self._new_event()
        if self._driver is None:
            event.record()
        else:
            self._check(self._driver.cuEventRecord(event.cuda_event, self._stream()), "cuEventRecord")
        return event

    def release(self, *events: torch.cuda.Event) -> None:
        """Events whose time was read: `mark` records them again."""
        self._free.extend(events)

    def _new_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # torch creates the CUDA event on its first record; the driver records it from then on
        return event

    def _index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    @staticmethod
    def _check(result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"{call} failed with CUDA driver error {result}")
