"""Pin glibc malloc's thresholds so tensor buffers are reused instead of faulted in anew.

glibc serves a large allocation with a fresh `mmap` until a freed one raises its threshold
(dynamically, from the history of the process), and gives the top of the heap back to the
kernel above 128 KiB free. PyTorch's CPU tensors come from malloc, so the same layer's
backward pass paid page faults for its multi-megabyte buffers in one process and not in
another: measured here on vgg11's deepest conv (4 rows, one thread), 7.4-11.7 ms by what
the process had allocated before, and 5.3-6.6 ms with the thresholds pinned (pinning the
mmap threshold alone: 7.8-16.5 ms); in one comparison the synced step fell from 117 to
99 ms. A profile taken in one state and a worker running in the other differ by that
much. Every worker (`runtime.run_spec`) and every profiling entry point pins them, so
both see the same allocator. Costs: up to `TRIM_THRESHOLD` of freed heap stays mapped per
process (vgg11's peak RSS was 3 % higher, measured).
"""
from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_THRESHOLD = 32 << 20
"""Allocations below this come from the heap (glibc's largest allowed fixed threshold)."""
TRIM_THRESHOLD = 256 << 20
"""Freed heap kept mapped before the top is returned to the kernel."""

_pinned = False


def pin_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (which also turns off their
    dynamic adjustment). Returns whether they are pinned; False where the C library has
    no `mallopt` (not glibc), which changes nothing else."""
    global _pinned
    if _pinned:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _pinned = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _pinned
