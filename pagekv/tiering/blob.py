"""The one on-store record format of a KV block, shared by every backend.

Owns: the byte layout of a stored block and its checks. A record is a header followed by the
payload; all integers little-endian::

    magic    4s   b"PGKV"
    version  H    FORMAT_VERSION (1), or KEYED_FORMAT_VERSION (2) when a secret keys the store
    fp_len   H    length of the fingerprint (model/layout identity of the cache)
    key_len  H    length of the UTF-8 key
    pay_len  Q    payload length
    crc      I    zlib.crc32 of the payload
    tag      32s  version 2 only: HMAC-SHA256, keyed by the secret, of every other byte of the
                  record (header, fingerprint, key, payload)
    fingerprint, key, payload

``decode`` checks everything it can before handing the payload back: the key and fingerprint
must match what the caller asked for (a store that returned another record is caught here), and
the checksum guards the payload against corruption at rest or in flight. A CRC32 guards against
accidents only: anyone who can write to a shared store can recompute it. With a secret
(``--kv-store-secret``) a record is accepted only with the tag that the secret makes, so a
forged record is refused (``ForgedRecordError``), and so is an unkeyed one.

Which errors say what, for the caller that decides whether to delete the record:

    CorruptBlockError   damaged, truncated, not a record, of another key or fingerprint
    ForgedRecordError   intact but not made with this secret (a subclass of the above)
    ForeignRecordError  of another format version: maybe another engine's, a newer pagekv's
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib

from pagekv.tiering.store import KVStoreError

FORMAT_VERSION = 1  # CRC32 only
KEYED_FORMAT_VERSION = 2  # CRC32 and an HMAC-SHA256 tag
MAGIC = b"PGKV"
_HEAD = struct.Struct("<4sHHHQI")
_TAG_SIZE = 32


class CorruptBlockError(KVStoreError):
    """A stored record that is damaged, truncated, of another format, key or fingerprint."""


class ForgedRecordError(CorruptBlockError):
    """An intact record whose HMAC tag this engine's secret did not make, or that has none."""


class ForeignRecordError(CorruptBlockError):
    """A record of another format version: another engine sharing the store may own it."""


def secret_tag(secret: bytes) -> str:
    """16 hex digits that name ``secret`` in store keys without revealing it (an HMAC of a
    constant), so engines with different secrets, or none, never read each other's records."""
    return hmac.new(secret, b"pagekv store key namespace", hashlib.sha256).hexdigest()[:16]


def header_size(key: str, fingerprint: bytes = b"", *, keyed: bool = False) -> int:
    """Bytes before the payload in the record of ``key`` and ``fingerprint``."""
    return _HEAD.size + _TAG_SIZE * keyed + len(fingerprint) + len(key.encode())


def encode(key: str, fingerprint: bytes, payload: bytes, secret: bytes | None = None) -> bytes:
    """One record: header, (the tag, when ``secret`` is given,) fingerprint, key, payload."""
    kb = key.encode()
    if len(kb) > 0xFFFF or len(fingerprint) > 0xFFFF:
        raise ValueError("key and fingerprint must be shorter than 64 KiB")
    version = FORMAT_VERSION if secret is None else KEYED_FORMAT_VERSION
    head = _HEAD.pack(MAGIC, version, len(fingerprint), len(kb), len(payload), zlib.crc32(payload))
    if secret is None:
        return b"".join((head, fingerprint, kb, payload))
    tag = _tag(secret, head, (fingerprint, kb, payload))
    return b"".join((head, tag, fingerprint, kb, payload))


def _tag(secret: bytes, head: bytes | memoryview, rest: tuple[bytes | memoryview, ...]) -> bytes:
    mac = hmac.new(secret, head, hashlib.sha256)
    for part in rest:
        mac.update(part)
    return mac.digest()


def decode(
    blob: bytes | bytearray | memoryview,
    key: str,
    fingerprint: bytes,
    secret: bytes | None = None,
) -> bytes:
    """The payload of ``blob``; CorruptBlockError unless it is an intact record of this key (and,
    given ``secret``, tagged with it: ForgedRecordError)."""
    if len(blob) < _HEAD.size:
        raise CorruptBlockError(f"{key}: truncated record ({len(blob)} bytes)")
    magic, version, fp_len, key_len, pay_len, crc = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptBlockError(f"{key}: not a pagekv record (magic {magic!r})")
    expected = FORMAT_VERSION if secret is None else KEYED_FORMAT_VERSION
    if version == FORMAT_VERSION and secret is not None:
        raise ForgedRecordError(f"{key}: record without an HMAC tag, and the store is keyed")
    if version != expected:
        raise ForeignRecordError(f"{key}: record format {version}, expected {expected}")
    body = _HEAD.size + (0 if secret is None else _TAG_SIZE)
    start = body + fp_len + key_len
    if len(blob) != start + pay_len:
        raise CorruptBlockError(f"{key}: {len(blob)} bytes, the header says {start + pay_len}")
    view = memoryview(blob)
    if view[body : body + fp_len] != fingerprint:
        raise CorruptBlockError(f"{key}: record of another fingerprint")
    if view[body + fp_len : start] != key.encode():
        raise CorruptBlockError(f"{key}: record of another key")
    payload = view[start:]
    if zlib.crc32(payload) != crc:
        raise CorruptBlockError(f"{key}: payload checksum mismatch")
    if secret is not None:
        tag = _tag(secret, view[: _HEAD.size], (view[body:],))
        if not hmac.compare_digest(tag, view[_HEAD.size : body]):
            raise ForgedRecordError(f"{key}: HMAC tag mismatch (forged, or another secret's)")
    return bytes(payload)
