"""What a store costs: one probe record written and read back, timed. Never imports torch."""

from __future__ import annotations

import time
import uuid

from pagekv.tiering.blob import CorruptBlockError, decode, encode
from pagekv.tiering.store import KVStore


def measure_store(
    store: KVStore, fingerprint: bytes, secret: bytes | None, payload_bytes: int, repeats: int = 3
) -> tuple[float, float]:
    """Seconds of one store round trip and of fetching one block: (fixed, per block), medians.

    Writes one probe record of a block's size and reads it back ``repeats`` times; raises
    ``KVStoreError`` if the store cannot be used.
    """
    key = f"pagekv/probe/{fingerprint.hex()[:32]}/{uuid.uuid4().hex}"
    record = encode(key, fingerprint, bytes(payload_bytes), secret)
    store.put(key, record)
    exists_s, get_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        store.batch_exists([key])
        t1 = time.perf_counter()
        blob = store.get(key)
        t2 = time.perf_counter()
        if blob is None:
            raise CorruptBlockError("the probe record vanished right after it was written")
        decode(blob, key, fingerprint, secret)
        exists_s.append(t1 - t0)
        get_s.append(t2 - t1)
    store.remove(key)  # best effort: a store may hold it a while (Mooncake's read lease)
    return sorted(exists_s)[repeats // 2], sorted(get_s)[repeats // 2]
