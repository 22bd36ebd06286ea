"""The allocator tuning of ``runner/host_memory.py``: freed activation-sized blocks are reused,
not faulted in again."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from pagekv.runner import host_memory

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
