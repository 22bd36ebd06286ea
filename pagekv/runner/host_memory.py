"""The C allocator's settings for the engine's process: keep freed activation memory for reuse.

Why: a prefill step's activations are tens of MB per layer (the gate/up product of 2,048 tokens
is 12.6 MB in bf16). glibc serves blocks above 128 KiB (its threshold adapts, but only up to
what was last freed) with fresh ``mmap`` pages and returns them to the system on ``free``, so
each step touches new pages again: on the ``random`` workload about 400-500k page faults and
1-1.4 s of system time per run, every fault also zeroing a page. Serving them from the heap and
not trimming it makes later steps reuse the same pages (about 20k faults, 0.1 s); peak memory
stays the same, since the step's tensors are the same sizes every step. vLLM reaches the same
end by preloading tcmalloc.

Only glibc has ``mallopt``; elsewhere (or with ``PAGEKV_MALLOC_TUNING=0``) nothing changes.
Imports nothing of pagekv.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

DISABLE_ENV = "PAGEKV_MALLOC_TUNING"
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20  # blocks up to this size come from the heap
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept up to this size

logger = logging.getLogger("pagekv")


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; True if they were set."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # no C library by that name, or not glibc
        logger.debug("mallopt unavailable; allocator left as it is")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    mmap_set: int = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    trim_set: int = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return mmap_set == trim_set == 1
