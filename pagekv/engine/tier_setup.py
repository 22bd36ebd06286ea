"""Start-up of the KV tiers below the device: open the store, measure it, wire the tier manager.

Owns nothing after start-up: it builds a ``TierManager`` (tiering/manager.py) over the KV cache
manager and the runner's tensors, and the ``LoadCostModel`` the scheduler waits by. An
unreachable store is a warning and the engine runs without it, unless ``kv_store_required``;
a spec that cannot work (an unwritable directory, an unknown scheme) is always an error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.plan import BlockTransfers, Plan, ScheduledRequest
from pagekv.core.preemption import PreemptionCostModel
from pagekv.core.request import Request
from pagekv.core.tier_policy import LoadCostModel
from pagekv.engine.config import EngineConfig
from pagekv.errors import InvalidRequestError
from pagekv.models.loader import LoadedModel, content_fingerprint
from pagekv.runner.model_runner import ModelRunner
from pagekv.sampling_params import SamplingParams
from pagekv.tiering.manager import BlockIO, TierManager
from pagekv.tiering.registry import open_store
from pagekv.tiering.store import KVStore, KVStoreError, StoreConfigError

logger = logging.getLogger("pagekv")


def open_configured_store(config: EngineConfig) -> KVStore | None:
    """The store ``config.kv_store`` names, or None (with a warning) if it cannot be reached."""
    if config.kv_store is None:
        return None
    if not isinstance(config.kv_store, str):
        return config.kv_store  # a store object the caller opened (and wrapped, in tests)
    try:
        return open_store(config.kv_store, timeout_s=config.kv_store_timeout_s)
    except StoreConfigError as exc:
        raise InvalidRequestError(f"kv_store: {exc}", "kv_store") from exc
    except KVStoreError as exc:
        if config.kv_store_required:
            raise InvalidRequestError(
                f"kv_store {config.kv_store!r} is unreachable and required: {exc}", "kv_store"
            ) from exc
        logger.warning("KV store %r is unreachable (%s); running without it", config.kv_store, exc)
        return None


def measure_prefill_s_per_token(runner: ModelRunner, num_tokens: int = 64) -> float:
    """Seconds per prompt token of one prefill on this machine now (the second of two runs).

    Uses the device pool's first blocks directly: at start-up nothing holds them, and a free
    block's contents are nobody's, so no manager state is touched.
    """
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request = Request("pagekv-startup-probe", list(range(100, 100 + num_tokens)), params)
    table = list(range(-(num_tokens // -runner.block_size)))
    plan = Plan(0, (ScheduledRequest(request, 0, num_tokens, table),), BlockTransfers())
    runner.execute(plan)  # warm-up
    start = time.perf_counter()
    runner.execute(plan)
    seconds = time.perf_counter() - start
    runner.release(request.request_id)
    return seconds / num_tokens


def build_tiers(
    config: EngineConfig,
    kv: KVCacheManager,
    runner: ModelRunner,
    loaded: LoadedModel,
    store: KVStore | None,
) -> tuple[TierManager, LoadCostModel]:
    """The tier manager, and the load cost model with the store's and the model's speed
    measured now (a probe record written and read back; a 64-token prefill)."""
    host_kv = runner.host_kv
    assert host_kv is not None, "lower tiers need a host pool"
    io = BlockIO(runner.kv.read_blocks, host_kv.read_blocks, host_kv.write_block)
    fingerprint = content_fingerprint(loaded) + config.block_size.to_bytes(4, "little")
    if runner.kv.quantized:  # records of 8-bit blocks are another layout (a float one: dtype's)
        fingerprint += f"kv:{runner.kv.dtype}".encode()
    secret = None if config.kv_store_secret is None else config.kv_store_secret.encode()
    retry_s = min(1.0, config.kv_store_timeout_s)
    tiers = TierManager(kv, io, fingerprint, store, retry_s=retry_s, secret=secret)
    cost = LoadCostModel(
        recompute_s_per_token=(
            config.preemption_cost or PreemptionCostModel()
        ).recompute_s_per_token,
        timeout_s=config.kv_store_timeout_s,
    )
    if store is None:
        return tiers, cost
    cost = replace(cost, recompute_s_per_token=measure_prefill_s_per_token(runner))
    try:
        fixed_s, per_block_s = tiers.measure(runner.kv.block_nbytes)
    except KVStoreError as exc:
        tiers.close()
        if config.kv_store_required:
            raise InvalidRequestError(
                f"kv_store {config.kv_store!r} failed its start-up probe: {exc}", "kv_store"
            ) from exc
        logger.warning(
            "KV store %r failed its probe (%s); running without it", config.kv_store, exc
        )
        return TierManager(kv, io, fingerprint, None), cost
    cost = replace(cost, load_s_fixed=fixed_s, load_s_per_block=per_block_s)
    logger.info(
        "KV store %s: %.2f ms per lookup, %.2f ms per block fetched (recompute: %.2f ms per block)",
        config.kv_store,
        fixed_s * 1e3,
        per_block_s * 1e3,
        cost.recompute_s(config.block_size) * 1e3,
    )
    return tiers, cost
