"""Give back the calling thread's OpenMP workers, so that one thread computing on the CPU at a time has the cores.

libgomp (the OpenMP runtime in PyTorch's CPU wheels) keeps a pool of worker threads for every thread that ran a
parallel region, for the life of that thread. Once the pools' threads outnumber the cores, every worker spins
only ~100 rounds before sleeping between regions, so each of the many small parallel calls of a decode step or
of a small model's update waits for workers to wake (`benchmarks/openmp_pools.py`: 2.3x slower small calls on 2
cores). The hybrid engine's two threads take turns: the engine's generates while the trainer's waits, then the
trainer's updates while the engine sleeps. Each gives its pool back before its idle turn (OpenMP 5's
`omp_pause_resource_all`, which in libgomp ends the calling thread's pool; the next parallel region makes a new
one). Other OpenMP runtimes pause every thread's pool, so only libgomp's is called.
"""

from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (PyTorch's own copy), or None (another runtime, not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
            library.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return library
        except (OSError, AttributeError):
            continue
    return None


def release_openmp_workers() -> bool:
    """End the calling thread's OpenMP worker pool (libgomp only); whether it was ended. Outside a parallel
    region only (it is, from Python)."""
    library = _libgomp()
    if library is None:
        return False
    return library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
