"""The storage-tier tests' fixtures: real store servers and one store per backend
(``tests/tiering/stores.py``)."""

from tests.tiering.stores import key, mooncake_master, redis_cluster_server, redis_server, store

__all__ = ["key", "mooncake_master", "redis_cluster_server", "redis_server", "store"]
