"""Timing and memory measurement for benchmarks.

Time: median of ``reps`` runs after one warm-up, wall clock (``perf_counter``); for a ceiling
(the machine's matmul rate) the fastest of ``reps`` runs after warm-ups (:func:`best_time`).
Memory: the kernel's own high-water mark of the process's resident set (``VmHWM``),
reset before the measured call through ``/proc/self/clear_refs`` and read after it;
"extra" is the peak minus the resident set just before the call, after
``malloc_trim`` has returned the allocator's free memory to the OS.
"""

from __future__ import annotations

import ctypes
import gc
import math
import statistics
import time
from collections.abc import Callable

_LIBC: ctypes.CDLL | None
try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: measurements still work, less tightly
    _LIBC = None


def _trim() -> None:
    """Give the allocator's free memory back to the OS, so the baseline RSS is honest
    (memory freed earlier but kept by malloc would otherwise absorb new allocations)."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def time_call(fn: Callable[[], object], reps: int = 3, warmup: int = 1, budget_s: float | None = None) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (fewer if ``budget_s`` runs out)."""
    for _ in range(warmup):
        fn()
    ts = []
    start = time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
    return statistics.median(ts)


def best_time(fn: Callable[[], object], reps: int = 5, warmup: int = 2, budget_s: float | None = None) -> float:
    """Fewest seconds of ``fn()`` over ``reps`` runs (fewer if ``budget_s`` runs out) after
    ``warmup`` untimed runs.  For a ceiling: noise (other processes, frequency dips) only ever
    slows a run down, so the fastest run is the closest to what the machine can do."""
    for _ in range(warmup):
        fn()
    best = math.inf
    start = time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
    return best


def _release_kept_scratch() -> None:
    """Memory a kernel keeps between calls for its own copies is charged to the measured call,
    not hidden in the warm-up: the native kernel's scratch for its large K/V packs
    (``build.release_scratch``) is freed first, so the measured call allocates it again."""
    from attnlab.ops.native import build

    if build.loaded():
        build.release_scratch()


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_supported() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status_kb("VmHWM")
        return True
    except OSError:
        return False


def peak_extra_bytes(fn: Callable[[], object], warmup: bool = True) -> int:
    """Peak resident memory ``fn()`` adds above what the process held before it (bytes).

    Whatever ``fn`` returns is kept alive until the peak is read, so outputs count.
    ``warmup`` runs ``fn`` once first, so that one-time costs (thread pools, BLAS
    workspaces, lazily built tables) are not charged to the measured call.
    """
    if warmup:
        fn()
    _release_kept_scratch()
    gc.collect()
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kb("VmRSS")
    result = fn()
    peak = _status_kb("VmHWM")
    del result
    return max(0, peak - before) * 1024
