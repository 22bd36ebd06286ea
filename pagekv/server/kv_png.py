"""The block map as a PNG picture, written by a tiny pure-Python PNG encoder (zlib + struct).

Same colours as ``/debug/kv``: grey free, blue in use (darker = higher ref count), amber
evictable. Used by ``pagekv kv-map --url ... --out map.png``; needs no plotting library.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

RGB = tuple[int, int, int]
BACKGROUND: RGB = (255, 255, 255)
FREE: RGB = (228, 228, 228)
EVICTABLE: RGB = (240, 180, 60)


def in_use_colour(ref_count: int) -> RGB:
    """Blue, darker for each extra reference (up to 6)."""
    step = min(max(ref_count, 1), 6) - 1
    return (max(20, 110 - 18 * step), max(50, 160 - 22 * step), max(120, 230 - 20 * step))


def block_colour(block: Mapping[str, Any]) -> RGB:
    if block["state"] == "in_use":
        return in_use_colour(int(block["ref_count"]))
    return EVICTABLE if block["state"] == "evictable" else FREE


def encode_png(width: int, height: int, rows: Sequence[bytes]) -> bytes:
    """An 8-bit RGB PNG from ``height`` rows of ``3 * width`` bytes each."""
    if len(rows) != height or any(len(r) != 3 * width for r in rows):
        raise ValueError("rows do not match width x height x RGB")

    def chunk(tag: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(tag + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bit, RGB, no interlace
    raw = b"".join(b"\x00" + row for row in rows)  # filter type 0 on every row
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def render_block_map(data: Mapping[str, Any], cell_px: int = 12, gap_px: int = 2) -> bytes:
    """A PNG with one ``cell_px`` square per physical block, in id order, row by row."""
    blocks = list(data["blocks"])
    columns = max(1, min(64, math.ceil(math.sqrt(len(blocks) * 2))))
    num_rows = max(1, math.ceil(len(blocks) / columns))
    pitch = cell_px + gap_px
    width, height = columns * pitch + gap_px, num_rows * pitch + gap_px
    rows: list[bytes] = []
    for y in range(height):
        row, cell_y = y // pitch, y % pitch
        line = bytearray(bytes(BACKGROUND) * width)
        if cell_y >= gap_px:
            for col in range(columns):
                index = row * columns + col
                if index >= len(blocks):
                    break
                x0 = col * pitch + gap_px
                line[3 * x0 : 3 * (x0 + cell_px)] = bytes(block_colour(blocks[index])) * cell_px
        rows.append(bytes(line))
    return encode_png(width, height, rows)
