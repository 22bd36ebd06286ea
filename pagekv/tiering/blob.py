"""The one on-store record format of a KV block, shared by every backend.

Owns: the byte layout of a stored block and its checks. A record is a header followed by the
payload; all integers little-endian::

    magic    4s   b"PGKV"
    version  H    FORMAT_VERSION
    fp_len   H    length of the fingerprint (model/layout identity of the cache)
    key_len  H    length of the UTF-8 key
    pay_len  Q    payload length
    crc      I    zlib.crc32 of the payload
    fingerprint, key, payload

``decode`` checks everything it can before handing the payload back: the key and fingerprint
must match what the caller asked for (a store that returned another record is caught here), and
the checksum guards the payload against corruption at rest or in flight.
"""

from __future__ import annotations

import struct
import zlib

from pagekv.tiering.store import KVStoreError

FORMAT_VERSION = 1
MAGIC = b"PGKV"
_HEAD = struct.Struct("<4sHHHQI")


class CorruptBlockError(KVStoreError):
    """A stored record that is damaged, truncated, of another format, key or fingerprint."""


def header_size(key: str, fingerprint: bytes = b"") -> int:
    """Bytes before the payload in the record of ``key`` and ``fingerprint``."""
    return _HEAD.size + len(fingerprint) + len(key.encode())


def encode(key: str, fingerprint: bytes, payload: bytes) -> bytes:
    """One record: header, fingerprint, key, payload."""
    kb = key.encode()
    if len(kb) > 0xFFFF or len(fingerprint) > 0xFFFF:
        raise ValueError("key and fingerprint must be shorter than 64 KiB")
    head = _HEAD.pack(
        MAGIC, FORMAT_VERSION, len(fingerprint), len(kb), len(payload), zlib.crc32(payload)
    )
    return b"".join((head, fingerprint, kb, payload))


def decode(blob: bytes | bytearray | memoryview, key: str, fingerprint: bytes) -> bytes:
    """The payload of ``blob``; CorruptBlockError unless it is an intact record of this key."""
    if len(blob) < _HEAD.size:
        raise CorruptBlockError(f"{key}: truncated record ({len(blob)} bytes)")
    magic, version, fp_len, key_len, pay_len, crc = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptBlockError(f"{key}: not a pagekv record (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"{key}: record format {version}, expected {FORMAT_VERSION}")
    start = _HEAD.size + fp_len + key_len
    if len(blob) != start + pay_len:
        raise CorruptBlockError(f"{key}: {len(blob)} bytes, the header says {start + pay_len}")
    view = memoryview(blob)
    if view[_HEAD.size : _HEAD.size + fp_len] != fingerprint:
        raise CorruptBlockError(f"{key}: record of another fingerprint")
    if view[_HEAD.size + fp_len : start] != key.encode():
        raise CorruptBlockError(f"{key}: record of another key")
    payload = view[start:]
    if zlib.crc32(payload) != crc:
        raise CorruptBlockError(f"{key}: payload checksum mismatch")
    return bytes(payload)
