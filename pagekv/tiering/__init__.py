"""pagekv.tiering: where cached KV blocks live beyond the device pool (host pool, storage tier).

Storage backends sit behind the small ``KVStore`` protocol of ``pagekv.tiering.store``; pick one
with ``open_store(spec)``. Every backend stores opaque bytes under content-address keys; the
record format (``pagekv.tiering.blob``) is applied one level up.
"""
