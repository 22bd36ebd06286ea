"""The KV sanitizer: a debug check that shared K/V never changes (on in tests, off in benchmarks).

Owns: the fingerprints of shared blocks. Reads the KV cache manager (who shares what) and the
runner's KV tensors (what is in them); changes neither. This is the tool for the silent
corruption sharing invites: a branch that writes into a block another branch still reads
produces no error, only wrong text. Two checks, each raising ``InvariantError`` naming the
block, its owners and the step:

    before execute   no token of the plan is written into a block with ref count > 1
    after execute    every block shared by two or more tables still has the fingerprint it had
                     when it was first seen shared (all layers, K and V)
"""

from __future__ import annotations

from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.plan import Plan
from pagekv.errors import InvariantError
from pagekv.runner.kv_cache import KVCache


class KVSanitizer:
    """Fingerprints shared blocks and checks them every step."""

    def __init__(self, manager: KVCacheManager, tensors: KVCache) -> None:
        self._manager = manager
        self._tensors = tensors
        self._fingerprints: dict[int, bytes] = {}

    def before_execute(self, plan: Plan) -> None:
        """(a) The plan writes no slot of a shared block; then fingerprint newly shared blocks
        (unless this plan's transfers are what fills them)."""
        ref, bs = self._manager.pool._ref, self._manager.block_size
        for entry in plan.scheduled:
            end = entry.start_position + entry.num_tokens
            for i in range(entry.start_position // bs, -(end // -bs)):
                block_id = entry.block_table[i]
                if ref[block_id] > 1:
                    owners = self._manager.block_owners().get(block_id, [])
                    raise InvariantError(
                        f"KV sanitizer, step {plan.step}: {entry.request.request_id!r} writes "
                        f"into block {block_id}, shared by {owners} (ref count {ref[block_id]})"
                    )
        filled = {dst for _, dst in (*plan.transfers.swap_in, *plan.transfers.copies)}
        new = [b for b in self._shared() if b not in self._fingerprints and b not in filled]
        self._fingerprints.update(zip(new, self._tensors.block_fingerprint(new), strict=True))

    def after_execute(self, plan: Plan) -> None:
        """(b) Every shared block still holds what it held when it was first seen shared."""
        owners = self._manager.block_owners()
        shared = self._shared(owners)
        prints = dict(zip(shared, self._tensors.block_fingerprint(shared), strict=True))
        for block_id, fingerprint in prints.items():
            recorded = self._fingerprints.get(block_id)
            if recorded is not None and recorded != fingerprint:
                raise InvariantError(
                    f"KV sanitizer, step {plan.step}: shared block {block_id} changed while "
                    f"shared by {owners[block_id]}"
                )
        # Keep the first fingerprint of blocks still shared; forget blocks no longer shared.
        self._fingerprints = {b: self._fingerprints.get(b, fp) for b, fp in prints.items()}

    def _shared(self, owners: dict[int, list[str]] | None = None) -> list[int]:
        owners = self._manager.block_owners() if owners is None else owners
        return sorted(b for b, who in owners.items() if len(who) > 1)
