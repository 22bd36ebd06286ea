"""Keyed records (``--kv-store-secret``): an HMAC-SHA256 tag that a forger cannot recompute.

Without a secret a record is guarded by a CRC32 only, which anyone who can write to the store
recomputes: a forged record is accepted, as before. With one it is refused, and so is an unkeyed
record or one made with another secret. Records of another format version are told apart
(``ForeignRecordError``): the tier leaves them in place, as another engine may own them. The
secret comes from ``--kv-store-secret`` (``EngineConfig.kv_store_secret``).
"""

from __future__ import annotations

import argparse
import struct
import zlib

import pytest

from pagekv.engine.args import add_engine_arguments, engine_config
from pagekv.engine.config import EngineConfig
from pagekv.errors import InvalidRequestError
from pagekv.tiering.blob import (
    FORMAT_VERSION,
    KEYED_FORMAT_VERSION,
    CorruptBlockError,
    ForeignRecordError,
    ForgedRecordError,
    decode,
    encode,
    header_size,
    secret_tag,
)

KEY = "pagekv/" + "ab" * 16 + "/" + "cd" * 32
FP = bytes(range(20))
PAYLOAD = bytes((i * 37) & 0xFF for i in range(50_000))
SECRET = b"correct horse battery staple"


def forge(record: bytes, keyed: bool) -> bytes:
    """Change the payload and recompute the CRC32, as a writer to a shared store can."""
    start = header_size(KEY, FP, keyed=keyed)
    payload = bytearray(record[start:])
    payload[100:200] = bytes(100)
    crc = struct.pack("<I", zlib.crc32(payload))  # the header's last field: bytes 18..21
    return record[:18] + crc + record[22:start] + bytes(payload)


def test_keyed_round_trip_and_layout() -> None:
    record = encode(KEY, FP, PAYLOAD, SECRET)
    assert len(record) == header_size(KEY, FP, keyed=True) + len(PAYLOAD)
    assert struct.unpack_from("<H", record, 4)[0] == KEYED_FORMAT_VERSION
    assert decode(record, KEY, FP, SECRET) == PAYLOAD
    assert decode(memoryview(record), KEY, FP, SECRET) == PAYLOAD
    assert struct.unpack_from("<H", encode(KEY, FP, PAYLOAD), 4)[0] == FORMAT_VERSION


def test_a_forged_record_passes_the_crc_alone_and_fails_the_tag() -> None:
    forged = forge(encode(KEY, FP, PAYLOAD), keyed=False)
    assert decode(forged, KEY, FP) != PAYLOAD  # accepted without a secret, as before
    forged = forge(encode(KEY, FP, PAYLOAD, SECRET), keyed=True)
    with pytest.raises(ForgedRecordError, match="HMAC"):
        decode(forged, KEY, FP, SECRET)


def test_unkeyed_or_other_secrets_records_are_refused() -> None:
    with pytest.raises(ForgedRecordError, match="without an HMAC tag"):
        decode(encode(KEY, FP, PAYLOAD), KEY, FP, SECRET)
    with pytest.raises(ForgedRecordError, match="HMAC"):
        decode(encode(KEY, FP, PAYLOAD, b"another secret"), KEY, FP, SECRET)


def test_damage_is_still_damage_and_other_formats_are_foreign() -> None:
    record = bytearray(encode(KEY, FP, PAYLOAD, SECRET))
    record[-1] ^= 0x01
    with pytest.raises(CorruptBlockError, match="checksum") as info:
        decode(bytes(record), KEY, FP, SECRET)
    assert not isinstance(info.value, ForgedRecordError | ForeignRecordError)
    keyed = encode(KEY, FP, PAYLOAD, SECRET)
    with pytest.raises(ForeignRecordError, match="format 2, expected 1"):
        decode(keyed, KEY, FP)  # an unkeyed engine never deletes a keyed record
    newer = keyed[:4] + struct.pack("<H", 3) + keyed[6:]
    with pytest.raises(ForeignRecordError, match="format 3"):
        decode(newer, KEY, FP, SECRET)


def test_the_secret_tag_names_the_secret_without_showing_it() -> None:
    tag = secret_tag(SECRET)
    assert len(tag) == 16 and int(tag, 16) >= 0
    assert tag == secret_tag(SECRET) != secret_tag(b"another secret")
    assert SECRET.hex()[:16] != tag


def test_the_secret_option_reaches_the_config_and_stays_out_of_its_repr() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--kv-store", "file:/tmp/kv", "--kv-store-secret", "s3cret"])
    config = engine_config(args)
    assert config.kv_store_secret == "s3cret" and "s3cret" not in repr(config)
    assert engine_config(parser.parse_args([])).kv_store_secret is None
    with pytest.raises(InvalidRequestError, match="kv_store_secret"):
        EngineConfig(kv_store_secret="")
