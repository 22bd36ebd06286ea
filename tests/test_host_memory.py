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


def _faults_per_allocation(rounds: int) -> float:
    """Minor page faults per fresh tensor of SHAPE, written whole and freed, as every step
    does with its activations. (Untuned, glibc maps a block this large afresh each time: its
    adaptive threshold stops at 32 MiB.)"""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        torch.ones(SHAPE)  # allocated, touched, freed
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds


@glibc_only
def test_freed_blocks_are_reused_without_page_faults() -> None:
    host_memory.keep_freed_memory.cache_clear()
    assert host_memory.keep_freed_memory()
    _faults_per_allocation(5)  # the first ones grow the heap
    pages = SHAPE[0] * SHAPE[1] * 4 // resource.getpagesize()
    # Untuned: a fresh mapping each time, one fault per page (12,288 here).
    assert _faults_per_allocation(10) < pages / 20


def test_tuning_can_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    host_memory.keep_freed_memory.cache_clear()
    monkeypatch.setenv(host_memory.DISABLE_ENV, "0")
    try:
        assert host_memory.keep_freed_memory() is False
    finally:
        host_memory.keep_freed_memory.cache_clear()
