"""The store registry: a spec's scheme picks a backend from one table, an unknown one is refused
naming every accepted form, and one table entry is all a new backend needs to be opened.

No servers: the backends that need one are only named here, never opened.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from pagekv.tiering import registry
from pagekv.tiering.memory_store import MemoryStore
from pagekv.tiering.registry import BACKENDS, Backend, open_store
from pagekv.tiering.store import StoreConfigError
from tests.structure.test_layers import modules_after

REPO = Path(__file__).resolve().parents[2]
ACCEPTED = (
    "'memory', 'file:DIR' (or an absolute or ./relative path), 'redis://HOST:PORT[/DB]', "
    "'redis-cluster://HOST:PORT', 'mooncake://HOST:PORT'"
)


class ToyStore(MemoryStore):
    """A backend defined by this test module: a MemoryStore that remembers how it was opened."""

    name = "toy"

    def __init__(self, spec: str, timeout_s: float) -> None:
        super().__init__()
        self.spec, self.timeout_s = spec, timeout_s


def open_spec(spec: str, timeout_s: float) -> ToyStore:
    """This module's opener, as a backend module provides one."""
    return ToyStore(spec, timeout_s)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("s3://bucket/x", "unknown store scheme in 's3://bucket/x'"),
        ("memory://", "unknown store scheme in 'memory://'"),
        ("nosuch", "unknown store spec 'nosuch'"),
        ("redis", "unknown store spec 'redis'"),
    ],
)
def test_unknown_scheme_is_refused_naming_every_accepted_form(spec: str, problem: str) -> None:
    with pytest.raises(StoreConfigError) as info:
        open_store(spec)
    assert str(info.value) == f"{problem}; accepted: {ACCEPTED}"


def test_every_scheme_names_an_importable_backend_with_an_opener() -> None:
    for scheme, backend in BACKENDS.items():
        assert callable(importlib.import_module(backend.module).open_spec), scheme


@pytest.mark.parametrize(
    ("spec", "scheme"),
    [
        ("file:d", "file"),
        ("file://d", "file"),
        ("/abs", "file"),
        ("./rel", "file"),
        ("../up", "file"),
        ("~/home", "file"),
        ("redis://h:1/2", "redis"),
        ("redis-cluster://h:1", "redis-cluster"),
        ("mooncake://h:1", "mooncake"),
    ],
)
def test_spec_forms_pick_their_scheme(spec: str, scheme: str) -> None:
    assert registry.scheme_of(spec) == scheme


def test_one_table_entry_makes_a_new_backend_openable(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StoreConfigError, match="unknown store scheme"):
        open_store("toy://somewhere")
    monkeypatch.setitem(BACKENDS, "toy", Backend(__name__, "toy://NAME"))
    store = open_store(" toy://somewhere ", timeout_s=2.5)
    assert isinstance(store, ToyStore)
    assert (store.spec, store.timeout_s) == ("toy://somewhere", 2.5)
    assert store.put("k", b"v") and store.get("k") == b"v"
    with pytest.raises(StoreConfigError) as info:
        open_store("s3://x")
    assert str(info.value).endswith(f"{ACCEPTED}, 'toy://NAME'")


def test_memory_and_file_open_without_any_client_library(tmp_path: Path) -> None:
    assert open_store("memory").name == "memory"
    assert open_store(f"file:{tmp_path / 'a'}").name == "file"
    with pytest.raises(StoreConfigError, match="names no directory"):
        open_store("file://")
    with pytest.raises(StoreConfigError, match="timeout_s must be positive"):
        open_store("memory", timeout_s=0)


def test_importing_the_registry_loads_no_backend() -> None:
    backends = ("pagekv.tiering.redis_store", "pagekv.tiering.mooncake_store")
    backends += ("pagekv.tiering.mooncake_spec", "pagekv.tiering.file_store")
    loaded = modules_after(
        "pagekv.tiering.registry, pagekv.tiering.store", ("redis", "mooncake", "torch", *backends)
    )
    assert loaded == []
    assert modules_after("pagekv.tiering.registry", ("pagekv.tiering.store",)) != []  # sees imports
