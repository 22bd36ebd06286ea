"""``runner/host_memory.py``: freed activation-sized blocks are reused, not faulted in again;
the KV pools sit on huge pages."""

from __future__ import annotations

import platform
import resource
from pathlib import Path

import pytest
import torch

from pagekv.runner import host_memory
from pagekv.runner.kv_cache import KVCache

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


SHAPE = (4096, 3072)  # a float32 gate/up product of a 4,096-token prefill step: 48 MiB


def _faults_per_allocation(rounds: int) -> list[int]:
    """Minor page faults of each of ``rounds`` fresh tensors of SHAPE, written whole and
    freed, as every step does with its activations. (Untuned, glibc maps a block this large
    afresh each time: its adaptive threshold stops at 32 MiB.)"""
    faults = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(SHAPE)  # allocated, touched, freed
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults


@glibc_only
def test_freed_blocks_are_reused_without_page_faults() -> None:
    host_memory.keep_freed_memory.cache_clear()
    assert host_memory.keep_freed_memory()
    _faults_per_allocation(5)  # the first ones grow the heap
    pages = SHAPE[0] * SHAPE[1] * 4 // resource.getpagesize()
    # Untuned: a fresh mapping each time, one fault per page (12,288 here). Tuned, a block
    # is reused; the heap may still grow once when something else took its place meanwhile.
    faults = _faults_per_allocation(10)
    assert sum(f < pages / 20 for f in faults) >= 8, faults


def test_tuning_can_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv(host_memory.DISABLE_ENV, "0")
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        host_memory.keep_freed_memory.cache_clear()


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str | None:
    """The bracketed word of the kernel's transparent-huge-page setting, or None if unknown."""
    try:
        text = Path(THP_SETTING).read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``, in bytes."""
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end ...
            start, end = (int(x, 16) for x in head.split("-"))
            found = start <= address < end
        elif found and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_kv_pool_memory_is_on_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(host_memory.HUGE_PAGES_ENV, raising=False)
    shape = (700, 16, 3, 64)  # 8.6 MB of bf16: a small KV pool of one layer
    pool = host_memory.zeros(shape, torch.bfloat16)
    assert pool.shape == shape and pool.dtype == torch.bfloat16
    assert not pool.any()  # zeroed, as torch.zeros
    assert pool.data_ptr() % host_memory.HUGE_PAGE_BYTES == 0
    assert _huge_bytes_at(pool.data_ptr()) >= host_memory.HUGE_PAGE_BYTES
    pool[3, 5] = 1.5  # an ordinary tensor otherwise
    assert float(pool.float().sum()) == 1.5 * 3 * 64


def test_huge_pages_can_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PAGEKV_HUGE_PAGES=0`` gives plain ``torch.zeros``: no mapping of ours is made. (Not
    checked through /proc/self/smaps: the heap block torch.zeros returns can lie in a mapping
    that something else of the process got huge pages for; seen once in a full run.)"""

    def no_mapping(*args: object, **kwargs: object) -> None:
        raise AssertionError("host_memory.zeros mapped memory with huge pages disabled")

    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "0")
    monkeypatch.setattr(host_memory.mmap, "mmap", no_mapping)
    pool = host_memory.zeros((700, 16, 3, 64), torch.bfloat16)
    assert pool.shape == (700, 16, 3, 64) and pool.dtype == torch.bfloat16
    assert not pool.any()
    if getattr(host_memory.mmap, "MADV_HUGEPAGE", None) is not None:
        monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "1")  # the spy is live: enabled maps
        with pytest.raises(AssertionError, match="mapped memory"):
            host_memory.zeros((700, 16, 3, 64), torch.bfloat16)


def test_kv_cache_pools_come_from_host_memory() -> None:
    """Both pools of every layer: zeroed, their own memory, the shape the kernels read."""
    cache = KVCache(2, 700, 16, 3, 64, torch.bfloat16)
    tensors = cache.k + cache.v
    assert len({t.data_ptr() for t in tensors}) == 4
    for t in tensors:
        assert t.shape == (700, 16, 3, 64) and t.is_contiguous() and not t.any()


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_arena_tensors_are_on_huge_pages_page_aligned_and_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(host_memory.HUGE_PAGES_ENV, raising=False)
    arena = host_memory.HugePageArena(8 << 20)
    shapes = [(100, 18, 16, 32), (7,), (1000, 576)]  # 1.8 MB, 14 B, 2.3 MB of bf16
    tensors = [arena.empty(shape, torch.bfloat16) for shape in shapes]
    for i, (t, shape) in enumerate(zip(tensors, shapes, strict=True)):
        assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert t.data_ptr() % host_memory.PAGE_BYTES == 0
        t.fill_(i + 1)
    for i, t in enumerate(tensors):  # no tensor overlaps another
        assert bool((t == i + 1).all())
    assert tensors[0].data_ptr() % host_memory.HUGE_PAGE_BYTES == 0  # the mapping's start
    assert _huge_bytes_at(tensors[0].data_ptr()) >= host_memory.HUGE_PAGE_BYTES
    past_end = arena.empty((4 << 20,), torch.bfloat16)  # 8 MB: more than is left
    assert past_end.shape == (4 << 20,)
    start = tensors[0].data_ptr()
    assert not start <= past_end.data_ptr() < start + (8 << 20)  # torch.empty's, not the arena's


def test_arena_without_huge_pages_is_torch_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_mapping(*args: object, **kwargs: object) -> None:
        raise AssertionError("HugePageArena mapped memory with huge pages disabled")

    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "0")
    monkeypatch.setattr(host_memory.mmap, "mmap", no_mapping)
    arena = host_memory.HugePageArena(8 << 20)
    t = arena.empty((1000, 576), torch.float32)
    assert t.shape == (1000, 576) and t.dtype == torch.float32
