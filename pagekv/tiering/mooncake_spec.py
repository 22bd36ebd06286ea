"""A ``mooncake://HOST:PORT[?OPTIONS]`` spec to a ``MooncakeStore`` (the store is
``mooncake_store``'s; this module owns only what its spec may say).

OPTIONS are ``segment_mb``, ``transfer_mb`` and ``local_buffer_mb`` (whole MiB) and
``local_hostname``, as ``MooncakeStore`` takes them; HOST:PORT is the master's RPC address.
"""

from __future__ import annotations

from pagekv.tiering.mooncake_store import MiB, MooncakeStore
from pagekv.tiering.store import StoreConfigError, split_address

_SIZE_OPTIONS = {"segment_mb", "transfer_mb", "local_buffer_mb"}  # whole MiB each


def open_spec(spec: str, timeout_s: float) -> MooncakeStore:
    """The store a ``mooncake://`` spec names; StoreConfigError for a path or a bad option."""
    host, port, path, query = split_address(spec, 50051)
    if path.strip("/"):
        raise StoreConfigError(f"bad store spec {spec!r}: no path is accepted")
    known = {*_SIZE_OPTIONS, "local_hostname"}
    if set(query) - known:
        raise StoreConfigError(
            f"bad store spec {spec!r}: unknown option(s) {sorted(set(query) - known)}; "
            f"accepted: {sorted(known)}"
        )
    try:
        sizes = {k: int(query[k]) * MiB for k in _SIZE_OPTIONS if k in query}
    except ValueError:
        raise StoreConfigError(f"bad store spec {spec!r}: sizes are whole MiB") from None
    return MooncakeStore(
        f"{host}:{port}",
        timeout_s=timeout_s,
        local_hostname=query.get("local_hostname", "127.0.0.1"),
        segment_bytes=sizes.get("segment_mb", 128 * MiB),
        transfer_bytes=sizes.get("transfer_mb", 32 * MiB),
        local_buffer_bytes=sizes.get("local_buffer_mb", 16 * MiB),
    )
