"""The on-store record format: a round trip, and every kind of damage raises CorruptBlockError."""

from __future__ import annotations

import struct

import pytest

from pagekv.tiering import blob
from pagekv.tiering.blob import CorruptBlockError, decode, encode, header_size
from pagekv.tiering.store import KVStoreError

KEY = "pagekv/" + "ab" * 16 + "/" + "cd" * 32
FP = bytes(range(32))
PAYLOAD = bytes((i * 37) & 0xFF for i in range(100_000))


@pytest.mark.parametrize("payload", [b"", b"x", PAYLOAD])
@pytest.mark.parametrize("fingerprint", [b"", FP])
def test_round_trip(payload: bytes, fingerprint: bytes) -> None:
    record = encode(KEY, fingerprint, payload)
    assert len(record) == header_size(KEY, fingerprint) + len(payload)
    assert record[:4] == b"PGKV"
    assert decode(record, KEY, fingerprint) == payload
    assert decode(bytearray(record), KEY, fingerprint) == payload
    assert decode(memoryview(record), KEY, fingerprint) == payload


def damaged(record: bytes, at: int) -> bytes:
    out = bytearray(record)
    out[at] ^= 0x01
    return bytes(out)


RECORD = encode(KEY, FP, PAYLOAD)
HEAD = header_size(KEY, FP)


@pytest.mark.parametrize(
    ("case", "record", "match"),
    [
        ("payload byte flipped", damaged(RECORD, HEAD + 1234), "checksum"),
        ("last payload byte flipped", damaged(RECORD, len(RECORD) - 1), "checksum"),
        ("checksum flipped", damaged(RECORD, 20), "checksum"),
        ("truncated payload", RECORD[:-1], "header says"),
        ("truncated header", RECORD[:10], "truncated"),
        ("empty", b"", "truncated"),
        ("extra bytes", RECORD + b"\0", "header says"),
        ("magic", damaged(RECORD, 0), "magic"),
        ("version", RECORD[:4] + struct.pack("<H", 2) + RECORD[6:], "format 2"),
        ("key byte flipped", damaged(RECORD, HEAD - 1), "another key"),
        ("fingerprint byte flipped", damaged(RECORD, 24), "another fingerprint"),
        ("length field", damaged(RECORD, 12), "header says"),
    ],
)
def test_damage_is_detected(case: str, record: bytes, match: str) -> None:
    with pytest.raises(CorruptBlockError, match=match):
        decode(record, KEY, FP)


def test_wrong_key_or_fingerprint() -> None:
    with pytest.raises(CorruptBlockError, match="another key"):
        decode(RECORD, KEY[:-1] + "e", FP)
    with pytest.raises(CorruptBlockError, match="another key"):
        decode(RECORD, KEY[:-1], FP)  # a prefix of the key is still another key
    with pytest.raises(CorruptBlockError, match="another fingerprint"):
        decode(RECORD, KEY, FP[::-1])
    with pytest.raises(CorruptBlockError):
        decode(RECORD, KEY, FP + b"\0")


def test_error_kinds_and_limits() -> None:
    assert issubclass(CorruptBlockError, KVStoreError)
    assert blob.FORMAT_VERSION == 1
    with pytest.raises(ValueError):
        encode("k" * 70_000, FP, b"")
