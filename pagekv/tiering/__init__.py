"""pagekv.tiering: where cached KV blocks live beyond the device pool (host pool, storage tier).

Storage backends sit behind the small ``KVStore`` protocol of ``pagekv.tiering.store``; pick one
with ``pagekv.tiering.registry.open_store(spec)``, which maps a spec's scheme to the backend's
module (``memory_store``, ``file_store``, ``redis_store``, ``mooncake_store``). Every backend
stores opaque bytes under content-address keys; the record format (``pagekv.tiering.blob``) is
applied one level up.
"""
