"""The KV tensors: one K pool and one V pool per layer, indexed by physical block id.

The runner owns these tensors; the core hands out block ids only and never sees them. A block id
names the same block in every layer, so copy-on-write and swapping move a block in all layers at
once. Every method here executes an instruction the core already decided (a copy list, a swap
list); none of them allocates or frees ids.

An 8-bit cache (``kv_dtype="int8"``, or ``"fp8"``: e4m3 values kept as their bits in uint8,
since CPU torch cannot index float8 tensors) keeps K and V rounded with one float16 scale per
token and KV head (``k_scale``/``v_scale``, [num_blocks, block_size, num_kv_heads]): a token's
row is written once and never rescaled, so a block shared by copy-on-write or a prefix hit
stays exact, and a scale per head keeps one loud head from flattening the others. Every plane
(data and scales) is indexed by block id first, so copies, swaps, host fills and store records
move a block's scales with it.

Must not import ``pagekv.core``, ``models`` or ``server``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from pagekv.errors import UnknownBlockError
from pagekv.runner import host_memory
from pagekv.runner.attention import write_kv

SCALE_DTYPE = torch.float16  # an 8-bit cache's per-row scales
EIGHT_BIT = (torch.int8, torch.uint8)  # int8 steps; fp8 e4m3 bits
KV_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8", "fp8_e4m3")


def storage_dtype(kv_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype K/V planes are kept in: the model's for "auto", else the one named (fp8:
    its bits, in uint8)."""
    named = {
        "float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8,
        "fp8": torch.uint8, "fp8_e4m3": torch.uint8,
    }  # fmt: skip
    if kv_dtype == "auto":
        return dtype
    if kv_dtype not in named:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return named[kv_dtype]


class KVCache:
    """Per-layer K and V pools: one [num_blocks, block_size, num_kv_heads, head_dim] tensor
    each; a block id indexes all layers.

    Owns the tensors ``k[layer]`` and ``v[layer]``. They start zeroed, so a fresh pool has
    stable fingerprints. Block ids out of range raise ``UnknownBlockError`` (a ``ValueError``).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        device: torch.device | str = "cpu",
        pinned: bool = False,
        kv_dtype: str = "auto",
    ) -> None:
        dims = {
            "num_layers": num_layers,
            "num_blocks": num_blocks,
            "block_size": block_size,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
        }
        for name, value in dims.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.quantized = storage_dtype(kv_dtype, dtype) in EIGHT_BIT
        self.dtype = storage_dtype(kv_dtype, dtype)  # the K/V planes' (int8: quantized)
        self.activations = dtype  # the model's: what rows arrive in and attention returns
        self.device = torch.device(device)
        self.pinned = pinned  # page-locked host memory (a GPU's host pool)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k: list[torch.Tensor] = [self._zeros(shape, self.dtype) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [self._zeros(shape, self.dtype) for _ in range(num_layers)]
        # each [num_blocks, block_size, num_kv_heads, head_dim]
        layers = range(num_layers if self.quantized else 0)
        self.k_scale = [self._zeros(shape[:3], SCALE_DTYPE) for _ in layers]
        self.v_scale = [self._zeros(shape[:3], SCALE_DTYPE) for _ in layers]
        # each [num_blocks, block_size, num_kv_heads] (int8 only): a row's dequantizing factor

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.pinned:
            return torch.zeros(shape, dtype=dtype, pin_memory=True)
        if self.device.type == "cpu":  # decode reads blocks all over the pool: 2 MiB pages
            return host_memory.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_dtype: str = "auto",
    ) -> int:
        """Bytes one block id costs: K and V (and an 8-bit cache's scales), all layers."""
        stored = storage_dtype(kv_dtype, dtype)
        row = head_dim * stored.itemsize + (SCALE_DTYPE.itemsize if stored in EIGHT_BIT else 0)
        return 2 * num_layers * block_size * num_kv_heads * row

    @property
    def layout(self) -> tuple[int, int, int, int, torch.dtype]:
        """What two pools must share for blocks to move between them (num_blocks may differ)."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def planes(self) -> list[torch.Tensor]:
        """Every tensor indexed by block id, in a block payload's order: K0 V0 K1 V1 ... then
        (int8) the scales, K0 V0 K1 V1 ...; what copies, swaps and store records move."""
        data = [p for kv in zip(self.k, self.v, strict=True) for p in kv]
        return data + [p for kv in zip(self.k_scale, self.v_scale, strict=True) for p in kv]

    def caches(self, layer: int) -> tuple[torch.Tensor, ...]:
        """What attention reads of ``layer``: (K, V), then (int8) their scales."""
        if self.quantized:
            return self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer]
        return self.k[layer], self.v[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """This step's K/V of ``layer`` into their slots, rounded to int8 if the cache is."""
        write_kv(*self.caches(layer), k, v, slots)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` <- block ``src`` for each (src, dst), in every layer.

        All sources are read before any destination is written, so a pair list behaves as one
        simultaneous copy even when a destination is also another pair's source.
        """
        self.transfer(self, pairs)

    def transfer(self, dst: KVCache, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy block ``src`` of this pool into block ``dst`` of pool ``dst``, every layer.

        Swap out is device pool -> host pool, swap in the reverse; the pools may live on
        different devices and hold different numbers of blocks, but must share ``layout``.
        """
        if dst.layout != self.layout:
            raise ValueError(
                f"KV cache layouts differ: (num_layers, block_size, num_kv_heads, head_dim, "
                f"dtype) {self.layout} vs {dst.layout}"
            )
        if not pairs:
            return
        src_ids = [src for src, _ in pairs]
        dst_ids = [d for _, d in pairs]
        if len(set(dst_ids)) != len(dst_ids):
            raise ValueError(f"a destination block appears twice in {list(pairs)}")
        src_index = self._index(src_ids)  # int64 [P] on self.device
        dst_index = dst._index(dst_ids)  # int64 [P] on dst.device
        for src_pool, dst_pool in zip(self.planes, dst.planes, strict=True):
            # index_select makes a copy first: that is what makes overlapping pairs safe.
            moved = src_pool.index_select(0, src_index).to(dst.device)  # [P, bs, kvh, D]
            dst_pool.index_copy_(0, dst_index, moved)

    @property
    def block_nbytes(self) -> int:
        return sum(p[0].nbytes for p in self.planes)

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each block's K/V as one bytes object: its part of every plane, in ``planes`` order.

        The payload the storage tier keeps (its layout is part of the engine's fingerprint).
        """
        if not block_ids:
            return []
        index = self._index(block_ids)  # int64 [N]
        n = len(block_ids)
        parts = [p.index_select(0, index).view(torch.uint8).reshape(n, -1) for p in self.planes]
        rows = torch.cat(parts, dim=1).cpu().numpy()  # [N, bytes]
        return [row.tobytes() for row in rows]

    def write_block(self, block_id: int, payload: bytes) -> None:
        """Fill one block from a ``read_blocks`` payload of the same layout."""
        if len(payload) != self.block_nbytes:
            raise ValueError(f"payload of {len(payload)} bytes; a block holds {self.block_nbytes}")
        index = self._index([block_id])
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        start = 0
        for plane in self.planes:
            size = plane[0].nbytes
            part = raw[start : start + size].clone().view(plane.dtype).view(plane.shape[1:])
            plane.index_copy_(0, index, part.unsqueeze(0))
            start += size

    def block_fingerprint(self, block_ids: Sequence[int]) -> list[bytes]:
        """An exact digest of each block's K and V bytes over all layers.

        For the debug KV sanitizer: fingerprint a block when it becomes shared, compare later.
        Hashes raw bytes, so it distinguishes 0.0 from -0.0 and NaN payloads, as it should.
        """
        if not block_ids:
            return []
        index = self._index(block_ids)  # int64 [N]
        hashers = [hashlib.blake2b(digest_size=16) for _ in block_ids]
        for pool in self.planes:
            # bytes [N, block_bytes]: a uint8 view works for every dtype, bfloat16 included.
            raw = pool.index_select(0, index).contiguous().view(torch.uint8)
            rows = raw.reshape(len(block_ids), -1).cpu().numpy()
            for hasher, row in zip(hashers, rows, strict=True):
                hasher.update(row.tobytes())
        return [hasher.digest() for hasher in hashers]

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Block ids as an int64 index tensor on this pool's device, range-checked."""
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise UnknownBlockError(f"block ids {bad} outside pool of {self.num_blocks} blocks")
        return torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
