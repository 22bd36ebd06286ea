"""The C allocator's settings for the engine's process: keep freed activation memory for reuse.

Why: a prefill step's activations are tens of MB per layer (the gate/up product of 2,048 tokens
is 12.6 MB in bf16). glibc serves blocks above 128 KiB (its threshold adapts, but only up to
what was last freed) with fresh ``mmap`` pages and returns them to the system on ``free``, so
each step touches new pages again, and every fault also zeroes a page. Serving them from the
heap and not trimming it makes later steps reuse the same pages; peak memory
stays the same, since the step's tensors are the same sizes every step. vLLM reaches the same
end by preloading tcmalloc.

Only glibc has ``mallopt``; elsewhere (or with ``PAGEKV_MALLOC_TUNING=0``) nothing changes.

Also here: ``zeros``, a zeroed tensor on 2 MiB pages where Linux allows them (transparent huge
pages in ``madvise`` mode, the common default), for the KV pools. A decode step reads blocks
scattered over the whole pool, so with 4 KiB pages nearly every block costs a TLB miss and a page
walk; one 2 MiB page covers 340 bf16 blocks of SmolLM2's layer. And ``HugePageArena``, the same
pages for the weights packed at load. ``PAGEKV_HUGE_PAGES=0`` (or no such pages) gives plain
``torch.zeros`` and ``torch.empty``.

Imports nothing of pagekv.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os

import torch

DISABLE_ENV = "PAGEKV_MALLOC_TUNING"
HUGE_PAGES_ENV = "PAGEKV_HUGE_PAGES"
HUGE_PAGE_BYTES = 2 << 20
PAGE_BYTES = mmap.PAGESIZE
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


def return_freed_memory() -> bool:
    """Give the heap's free memory back to the system now (glibc's ``malloc_trim``): once,
    after loading, whose temporaries ``keep_freed_memory`` would otherwise keep resident."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, on 2 MiB pages when the system grants
    them (an anonymous mapping advised ``MADV_HUGEPAGE``, 2 MiB aligned); the pages are touched
    here, so the tensor is resident from the start, as ``torch.zeros`` would be."""
    nbytes = _nbytes(shape, dtype)
    raw = _huge_mapping(nbytes) if nbytes >= HUGE_PAGE_BYTES else None
    if raw is None:
        return torch.zeros(shape, dtype=dtype)
    # Fault every page in now with one write per 4 KiB page: the system zeroes what it maps,
    # so zeroing it again (zero_()) would only double the start-up cost.
    raw[::PAGE_BYTES].fill_(0)
    return raw.view(dtype).view(shape)


class HugePageArena:
    """Tensors carved one after another from one mapping on 2 MiB pages, for weights packed at
    load (``LayerOps.pack``'s ``allocate``): a decode step streams every packed weight once,
    and with 4 KiB pages the hardware prefetcher stops at each page's end and every page costs
    a TLB miss. Each tensor starts on a 4 KiB boundary; pages are faulted in as they are written,
    so an arena larger than its use costs only address space. Past its end, or where huge pages
    are off or unavailable, ``empty`` is ``torch.empty``."""

    def __init__(self, nbytes: int) -> None:
        self._raw = _huge_mapping(nbytes) if nbytes >= HUGE_PAGE_BYTES else None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = _nbytes(shape, dtype)
        raw, start = self._raw, self._used
        if raw is None or start + nbytes > raw.numel():
            return torch.empty(shape, dtype=dtype)
        self._used = start + -(-nbytes // PAGE_BYTES) * PAGE_BYTES
        return raw[start : start + nbytes].view(dtype).view(shape)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    nbytes = dtype.itemsize
    for size in shape:
        nbytes *= size
    return nbytes


def _huge_mapping(nbytes: int) -> torch.Tensor | None:
    """uint8 [nbytes] of a fresh anonymous mapping advised ``MADV_HUGEPAGE``, starting on a
    2 MiB boundary, pages not yet faulted in; None where huge pages are off or unavailable."""
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if os.environ.get(HUGE_PAGES_ENV, "1") == "0" or advise is None:
        return None
    try:
        # private (a shared mapping would be shmem, whose huge pages are a separate setting),
        # with room to start on a 2 MiB boundary
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=flags)
        mapping.madvise(advise)
    except (OSError, ValueError) as exc:  # no such advice here, or no memory
        logger.debug("huge pages unavailable (%s); plain pages", exc)
        return None
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start : start + nbytes]
