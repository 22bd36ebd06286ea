"""Which storage backend a store spec names: the table of backends, and ``open_store``.

Owns the spec syntax: ``SCHEME://...`` names the backend registered for SCHEME, ``memory`` is
an in-process ``MemoryStore``, and ``file:DIR`` or a bare path (``/``, ``./``, ``../``, ``~``)
is the file backend. A backend is a module with an ``open_spec(spec, timeout_s)`` (a
``store.Opener``) that parses the rest of its spec. It is imported on first use, by the name
in its table entry, so a client library (redis, mooncake) loads only when a spec names it.

Adding a backend: its module, and one line in ``BACKENDS``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from pagekv.tiering.memory_store import MemoryStore
from pagekv.tiering.store import KVStore, Opener, StoreConfigError

MEMORY_SPEC = "memory"
FILE_SHORTHANDS = ("file:", "/", "./", "../", "~")  # specs without "://" that name a directory


@dataclass(frozen=True)
class Backend:
    """A registered backend: the module whose ``open_spec`` opens it, and the spec form that
    error messages show (with an optional note)."""

    module: str
    form: str
    note: str = ""

    def shown(self) -> str:
        return f"'{self.form}'" + (f" ({self.note})" if self.note else "")


# URL scheme -> backend, in the order error messages list them.
BACKENDS: dict[str, Backend] = {
    "file": Backend("pagekv.tiering.file_store", "file:DIR", "or an absolute or ./relative path"),
    "redis": Backend("pagekv.tiering.redis_store", "redis://HOST:PORT[/DB]"),
    "redis-cluster": Backend("pagekv.tiering.redis_store", "redis-cluster://HOST:PORT"),
    "mooncake": Backend("pagekv.tiering.mooncake_spec", "mooncake://HOST:PORT"),
}


def accepted_specs() -> str:
    """Every spec form, for the message of a spec no backend takes."""
    return ", ".join([f"'{MEMORY_SPEC}'", *(b.shown() for b in BACKENDS.values())])


def open_store(spec: str, *, timeout_s: float = 5.0) -> KVStore:
    """Open the store that ``spec`` names; raises StoreConfigError for a spec it cannot accept.

    A server that cannot be reached at open time raises StoreUnavailableError.
    """
    if timeout_s <= 0:
        raise StoreConfigError(f"timeout_s must be positive, got {timeout_s}")
    spec = spec.strip()
    if spec == MEMORY_SPEC:
        return MemoryStore()
    return _opener(scheme_of(spec))(spec, timeout_s)


def scheme_of(spec: str) -> str:
    """The registered scheme a (stripped) spec names; StoreConfigError naming the accepted
    forms when none does."""
    scheme, sep, _ = spec.partition("://")
    if sep:
        if scheme not in BACKENDS:
            raise StoreConfigError(
                f"unknown store scheme in {spec!r}; accepted: {accepted_specs()}"
            )
        return scheme
    if spec.startswith(FILE_SHORTHANDS):
        return "file"
    raise StoreConfigError(f"unknown store spec {spec!r}; accepted: {accepted_specs()}")


def _opener(scheme: str) -> Opener:
    module = importlib.import_module(BACKENDS[scheme].module)
    opener: Opener = module.open_spec
    return opener
