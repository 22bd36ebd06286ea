"""Reading a GGUF file: its metadata, its tensor directory, and tensors as float32 numpy arrays.

Owns the byte layout of GGUF (versions 2 and 3) and nothing about models: names are llama.cpp's,
shapes are in numpy order (GGUF lists dimensions innermost first; we reverse them here, once).

We parse the header with `struct` instead of `gguf.GGUFReader`: the reader builds one numpy view
per array element, which costs ~3 s on SmolLM2's 98k tokenizer strings, where this takes ~0.1 s.
Tensor payloads still go through `gguf.quants.dequantize`, the reference implementation.

Every way a file can be wrong (not GGUF, truncated, corrupt directory, unknown tensor type) raises
`ModelLoadError` naming the file and the problem. Must not import torch.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from pagekv.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT_BYTES = 32
MAX_DIMS = 4

# value type -> (struct of one element, numpy dtype for bulk array reads)
_SCALARS: dict[GGUFValueType, tuple[struct.Struct, str]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), "<u1"),
    GGUFValueType.INT8: (struct.Struct("<b"), "<i1"),
    GGUFValueType.UINT16: (struct.Struct("<H"), "<u2"),
    GGUFValueType.INT16: (struct.Struct("<h"), "<i2"),
    GGUFValueType.UINT32: (struct.Struct("<I"), "<u4"),
    GGUFValueType.INT32: (struct.Struct("<i"), "<i4"),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), "<f4"),
    GGUFValueType.BOOL: (struct.Struct("<?"), "?"),
    GGUFValueType.UINT64: (struct.Struct("<Q"), "<u8"),
    GGUFValueType.INT64: (struct.Struct("<q"), "<i8"),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), "<f8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file and how it is encoded."""

    name: str
    shape: tuple[int, ...]  # numpy order: rows first, the quantized (innermost) dim last
    qtype: GGMLQuantizationType
    offset_bytes: int  # absolute, from the start of the file
    num_bytes: int


class _Cursor:
    """A read position over the file's bytes; every read is bounds-checked."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def error(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: corrupt or truncated GGUF file: {what}")

    def read(self, fmt: struct.Struct) -> object:
        if self.pos + fmt.size > len(self.buf):
            raise self.error(f"header ends early at byte {self.pos} of {len(self.buf)}")
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def read_int(self, fmt: struct.Struct) -> int:
        value = self.read(fmt)
        assert isinstance(value, int)
        return value

    def read_count(self, what: str) -> int:
        """A u64 count of items that each take at least one byte (so it is bounded by the file)."""
        count = self.read_int(_U64)
        if count > len(self.buf) - self.pos:
            raise self.error(f"{what} count {count} at byte {self.pos - 8} exceeds the file size")
        return count

    def read_str(self) -> str:
        num_bytes = self.read_count("string length")
        raw = bytes(self.buf[self.pos : self.pos + num_bytes])
        self.pos += num_bytes
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"string at byte {self.pos - num_bytes} is not UTF-8") from exc

    def read_type(self) -> GGUFValueType:
        raw_type = self.read_int(_U32)
        try:
            return GGUFValueType(raw_type)
        except ValueError as exc:
            raise self.error(f"unknown metadata value type {raw_type} at byte {self.pos}") from exc

    def read_value(self, vtype: GGUFValueType) -> object:
        if vtype == GGUFValueType.STRING:
            return self.read_str()
        if vtype == GGUFValueType.ARRAY:
            return self.read_array()
        return self.read(_SCALARS[vtype][0])

    def read_array(self) -> list[object]:
        vtype = self.read_type()
        count = self.read_count("array length")
        scalar = _SCALARS.get(vtype)
        if scalar is None:
            return [self.read_value(vtype) for _ in range(count)]
        num_bytes = count * scalar[0].size
        if self.pos + num_bytes > len(self.buf):
            raise self.error(f"array at byte {self.pos} runs past the end of the file")
        # Bulk read: token types / scores arrays hold ~50k numbers.
        values = np.frombuffer(self.buf, dtype=scalar[1], count=count, offset=self.pos)
        self.pos += num_bytes
        return list(values.tolist())


class GGUFFile:
    """One opened GGUF file. Owns a read-only memory map of it, released with the object."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            data = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:  # ValueError: numpy refuses to map an empty file
            raise ModelLoadError(f"{path}: cannot read GGUF file: {exc}") from exc
        self._data = data
        cursor = _Cursor(data.data, path)
        try:
            num_tensors, metadata = _read_metadata(cursor)
        except RecursionError as exc:  # arrays of arrays nested absurdly deep
            raise cursor.error("metadata arrays nested too deeply") from exc
        self.metadata: Mapping[str, object] = metadata
        self.tensors: Mapping[str, GGUFTensorInfo] = _read_tensor_infos(
            cursor, num_tensors, metadata
        )

    def blocks(self, name: str) -> np.ndarray:
        """The tensor's bytes as they are in the file, uint8 [*shape[:-1], bytes per row]: a
        read-only view of the map."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path}: missing tensor {name!r}")
        raw = self._data[info.offset_bytes : info.offset_bytes + info.num_bytes]
        block_size, type_size = GGML_QUANT_SIZES[info.qtype]
        row_bytes = info.shape[-1] // block_size * type_size
        return np.asarray(raw).reshape((*info.shape[:-1], row_bytes))

    def read_tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy shape order. May be a read-only view."""
        rows = self.blocks(name)  # raises for a missing one
        info = self.tensors[name]
        try:
            values = dequantize(rows, info.qtype)
        except NotImplementedError as exc:
            raise ModelLoadError(f"{self.path}: tensor {name!r}: {exc}") from exc
        return values.reshape(info.shape)


def _read_metadata(cursor: _Cursor) -> tuple[int, dict[str, object]]:
    magic = bytes(cursor.buf[:4])
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{cursor.path}: not a GGUF file (magic bytes {magic!r})")
    cursor.pos = 4
    version = cursor.read_int(_U32)
    if version not in SUPPORTED_VERSIONS:
        raise ModelLoadError(f"{cursor.path}: unsupported GGUF version {version}")
    num_tensors = cursor.read_count("tensor")
    num_kv = cursor.read_count("metadata key")
    metadata: dict[str, object] = {"GGUF.version": version}
    for _ in range(num_kv):
        key = cursor.read_str()
        metadata[key] = cursor.read_value(cursor.read_type())
    return num_tensors, metadata


def _read_tensor_infos(
    cursor: _Cursor, num_tensors: int, metadata: Mapping[str, object]
) -> dict[str, GGUFTensorInfo]:
    """The tensor directory, with every tensor's byte range checked against the file size."""
    entries = []
    for _ in range(num_tensors):
        name = cursor.read_str()
        num_dims = cursor.read_int(_U32)
        if not 1 <= num_dims <= MAX_DIMS:
            raise cursor.error(f"tensor {name!r} has {num_dims} dimensions")
        dims = [cursor.read_int(_U64) for _ in range(num_dims)]
        raw_type = cursor.read_int(_U32)
        rel_offset = cursor.read_int(_U64)
        entries.append((name, tuple(reversed(dims)), raw_type, rel_offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT_BYTES)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cursor.error(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, shape, raw_type, rel_offset in entries:
        info = _tensor_info(cursor, name, shape, raw_type, data_start + rel_offset)
        tensors[name] = info
    return tensors


def _tensor_info(
    cursor: _Cursor, name: str, shape: tuple[int, ...], raw_type: int, offset_bytes: int
) -> GGUFTensorInfo:
    try:
        qtype = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{cursor.path}: tensor {name!r} has unknown type {raw_type}") from exc
    if any(d <= 0 for d in shape) or shape[-1] % block_size:
        raise cursor.error(f"tensor {name!r} has invalid shape {shape} for {qtype.name}")
    num_bytes = int(np.prod(shape, dtype=np.int64)) // block_size * type_size
    end = offset_bytes + num_bytes
    if end > len(cursor.buf):
        raise ModelLoadError(
            f"{cursor.path}: truncated GGUF file: tensor {name!r} needs bytes "
            f"[{offset_bytes}, {end}) but the file has {len(cursor.buf)} bytes"
        )
    return GGUFTensorInfo(name, shape, qtype, offset_bytes, num_bytes)
