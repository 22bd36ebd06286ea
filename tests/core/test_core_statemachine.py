"""A hypothesis state machine driving ``KVCacheManager`` against a plain-Python model.

The model keeps, per live request, the tokens it should see, and simulates the physical KV
contents (``SimulatedKV``): transfers are applied the way the runner applies them (swap_out,
swap_in, copies), then new tokens are written into their slots through the block table. After
every step, reading each live request's history through its table (device, or host while
swapped) must give exactly its own tokens, and every block in the prefix-cache index must hold
the K/V its hash names. ``check_manager`` runs after every rule.

Protocol, as the scheduler follows it: ``allocate``/``append_slots`` make a request *busy*
(its tokens will be written this step); a busy request is not forked, freed, swapped or grown
again until the step ends. Other requests may be admitted, forked, freed, preempted, swapped and
committed freely in between, so pending transfers pile up across many calls before one
``take_transfers``.
"""

from __future__ import annotations

import dataclasses
import sys

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagekv.core import KVCacheManager, Plan, Request, ScheduledRequest
from pagekv.core.invariants import check_manager, check_no_leak, check_plan
from pagekv.core.tier_policy import WritePolicy
from pagekv.errors import PromptTooLongError
from tests.core.helpers import (
    Signature,
    SimulatedKV,
    cdiv,
    expected_history,
    make_request,
    manager_state,
    signature,
)

TOKENS = st.integers(0, 2)  # a tiny alphabet, so prompts share prefixes
SALTS = st.sampled_from([None, None, None, "tenant-a", "tenant-b"])


class KVManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr: KVCacheManager | None = None
        self.live: dict[str, Request] = {}  # device or swapped
        self.busy: dict[str, int] = {}  # request id -> tokens to write this step
        self.waiting: list[Request] = []  # preempted by recompute: no blocks, computed = 0
        self.history: list[tuple[tuple[int, ...], str | None]] = []
        self.hash_content: dict[bytes, list[Signature]] = {}  # block hash -> K/V it must hold
        self.num_ids = 0
        self.num_steps = 0

    # ---- setup ---------------------------------------------------------------------------------

    @initialize(
        num_blocks=st.integers(8, 24),
        block_size=st.integers(1, 4),
        num_host_blocks=st.sampled_from([16, 8, 4, 16, 8, 0]),
        write_policy=st.sampled_from([None, *WritePolicy]),
        storage=st.booleans(),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int,
        write_policy: WritePolicy | None,
        storage: bool,
    ) -> None:
        self.mgr = KVCacheManager(
            num_blocks,
            block_size,
            True,
            num_host_blocks,
            write_policy=write_policy,
            write_storage=storage,
        )
        self.bs = block_size
        self.kv = SimulatedKV(num_blocks, num_host_blocks, block_size)
        self.corrupt: set[int] = set()  # host blocks whose bytes a rule damaged
        # The tier manager's check, played by the simulation: the block holds its hash's K/V.
        self.mgr.tier_state.verify_host = lambda b, h: self.kv.host[b] == self.hash_content.get(h)
        self.max_tokens = (num_blocks // 2) * block_size  # no request outgrows half the pool
        self.max_prompt = min(self.max_tokens, 3 * block_size + 2)

    @property
    def m(self) -> KVCacheManager:
        assert self.mgr is not None
        return self.mgr

    def _new_id(self) -> str:
        self.num_ids += 1
        return f"r{self.num_ids}"

    # ---- candidate lists (also used by preconditions) -------------------------------------------

    def _idle(self) -> list[str]:
        return sorted(r for r in self.live if r not in self.busy)

    def _idle_device(self) -> list[str]:
        return [r for r in self._idle() if self.m.has_table(r)]

    def _swapped(self) -> list[str]:
        return [r for r in self._idle() if self.m.is_swapped(r)]

    def _appendable(self) -> list[str]:
        return [
            r
            for r in self._idle_device()
            if self.live[r].num_computed_tokens < self.live[r].num_tokens
        ]

    def _cow_candidates(self) -> list[str]:
        """Requests whose next write lands in a block they share (a fork's partial block)."""
        out = []
        for rid in self._appendable():
            table = self.m.block_table(rid)
            i = self.live[rid].num_computed_tokens // self.bs
            if i < len(table) and self.m.pool.ref_count(table[i]) > 1:
                out.append(rid)
        return out

    def _sharers(self) -> list[str]:
        """Requests holding a block someone else holds too, on the device or as a host twin."""
        mgr = self.m
        return [
            r
            for r in self._idle_device()
            if any(
                mgr.pool.ref_count(b) > 1 or b in mgr.pending.host_twin for b in mgr.block_table(r)
            )
        ]

    def _twin_writers(self) -> list[str]:
        """Requests whose next write lands in a block that has a copy on the host."""
        out = []
        for rid in self._appendable():
            table = self.m.block_table(rid)
            i = self.live[rid].num_computed_tokens // self.bs
            if i < len(table) and table[i] in self.m.pending.host_twin:
                out.append(rid)
        return out

    # ---- admission: new prompts, prefix hits, eviction under pressure, resumption ---------------

    def _remember(self, request: Request) -> None:
        self.history.append((tuple(request.all_token_ids), request.cache_salt))
        for i, block_hash in enumerate(request.block_hashes):
            content = [signature(request, i * self.bs + j) for j in range(self.bs)]
            assert self.hash_content.setdefault(block_hash, content) == content

    def _expected_hits(self, request: Request, num_blocks: int) -> list[tuple[int, bool]]:
        """Each cached block where the manager must find it: the device, else the host."""
        mgr, hits = self.m, []
        for block_hash in request.block_hashes[:num_blocks]:
            device, host = mgr.residency(block_hash)
            assert device is not None or host is not None, "a counted hit the tiers do not hold"
            hits.append((device, False) if device is not None else (host, True))
        return hits  # type: ignore[return-value]

    def _admit(self, request: Request, chunk: int) -> None:
        """Allocate as the scheduler does: look up hits, then allocate the next chunk."""
        mgr, pool, bs = self.m, self.m.pool, self.bs
        cached = mgr.num_cached_tokens(request)
        assert cached % bs == 0
        assert cached <= (request.num_tokens - 1) // bs * bs, "the last token must be recomputed"
        hits = self._expected_hits(request, cached // bs)
        device_hits = [b for b, on_host in hits if not on_host]
        num_new = min(chunk, request.num_tokens - cached)
        can = mgr.can_allocate(request, num_new)
        need = cdiv(cached + num_new, bs) - len(device_hits)
        room = pool.num_free_blocks - sum(1 for b in device_hits if pool.is_evictable(b))
        num_free_before, evictions_before = len(list(pool.iter_free())), pool.num_evictions
        failures_before = mgr.tier_state.counters.host_verify_failures
        before = manager_state(mgr)
        try:
            got = mgr.allocate(request, num_new)
        except PromptTooLongError:
            assert cdiv(request.num_tokens, bs) > pool.num_blocks
            assert manager_state(mgr) == before
            return
        verify_failed = mgr.tier_state.counters.host_verify_failures > failures_before
        if verify_failed:
            assert any(b in self.corrupt for b, on_host in hits if on_host), "a sound block failed"
        if got is None:
            assert verify_failed or (not can and need > room), "allocate refused with room"
            if not verify_failed:
                assert manager_state(mgr) == before
            return
        assert got == cached or (verify_failed and got < cached)
        assert can or verify_failed
        table = mgr.block_table(request.request_id)
        assert len(table) == cdiv(got + num_new, bs)
        for i, (block_id, on_host) in enumerate(hits[: got // bs]):
            if on_host:  # a host hit: a fresh device block, filled by a swap-in this step
                assert mgr.pending.swap_in[table[i]] == block_id and mgr.host_pins()[block_id] >= 1
            else:
                assert table[i] == block_id, "device hits must keep their place in the table"
                assert pool.block_hash(block_id) == request.block_hashes[i], "hit was evicted"
        if not verify_failed:
            # FREE blocks are handed out before any cached block is evicted.
            assert pool.num_evictions - evictions_before == max(0, need - num_free_before)
        request.num_computed_tokens = got
        self.live[request.request_id] = request
        self.busy[request.request_id] = num_new
        self._remember(request)

    @rule(data=st.data(), salt=SALTS, chunk=st.integers(1, 16))
    def new_request(self, data: st.DataObject, salt: str | None, chunk: int) -> None:
        tokens = data.draw(st.lists(TOKENS, min_size=1, max_size=self.max_prompt))
        self._admit(make_request(self._new_id(), tokens, salt=salt), chunk)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def prefix_hit(self, data: st.DataObject, chunk: int) -> None:
        tokens, salt = data.draw(st.sampled_from(self.history))
        keep = data.draw(st.integers(1, len(tokens)))
        tail = data.draw(st.lists(TOKENS, max_size=3))
        salt = data.draw(st.sampled_from([salt, salt, salt, "tenant-c"]))
        prompt = [*tokens[:keep], *tail][: self.max_tokens]
        self._admit(make_request(self._new_id(), prompt, salt=salt), chunk)

    @precondition(lambda self: self.m.pool.num_evictable_blocks > 0)
    @rule(data=st.data(), salt=SALTS)
    def evict_under_pressure(self, data: st.DataObject, salt: str | None) -> None:
        pool = self.m.pool
        extra = data.draw(st.integers(1, pool.num_evictable_blocks))
        length = min((len(list(pool.iter_free())) + extra) * self.bs, self.max_tokens)
        tokens = data.draw(st.lists(TOKENS, min_size=length, max_size=length))
        self._admit(make_request(self._new_id(), tokens, salt=salt), length)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def resume(self, data: st.DataObject, chunk: int) -> None:
        request = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        self._admit(request, chunk)

    @precondition(lambda self: self.kv.storage and self.m.tier_state.host_caching)
    @rule(data=st.data())
    def prefetch(self, data: st.DataObject) -> None:
        """Blocks the storage tier holds come back into host blocks (the tier manager's job)."""
        hashes = data.draw(st.lists(st.sampled_from(sorted(self.kv.storage)), max_size=4))
        host = self.m.host_pool
        assert host is not None
        placed = self.m.tier_state.load_host(hashes)
        for block_hash, host_block in placed:
            assert host.block_hash(host_block) == block_hash
            assert self.m.host_pins()[host_block] >= 1, "a load's destination must be pinned"
            assert self.m.residency(block_hash)[0] is None, "loaded a block already on the device"

    @precondition(
        lambda self: self.m.tier_state.host_caching and self.m.host_pool.num_evictable_blocks
    )
    @rule(data=st.data())
    def corrupt_host_block(self, data: st.DataObject) -> None:
        """Damage a cached host block's bytes: verification must keep it from being used."""
        host = self.m.host_pool
        assert host is not None
        block_id = data.draw(st.sampled_from(sorted(host.iter_evictable())))
        if block_id in self.m.pending.swap_out or block_id in self.m.tier_state.pending_loads:
            return  # its K/V is still on the way in and will overwrite the damage
        self.kv.host[block_id] = [None] * self.bs
        self.corrupt.add(block_id)

    # ---- growth: prefill chunks, decode, writes into forks -------------------------------------

    def _append(self, rid: str, num_new: int) -> bool:
        mgr, pool, bs = self.m, self.m.pool, self.bs
        request = self.live[rid]
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        table = list(mgr.block_table(rid))
        grow = max(0, cdiv(end, bs) - len(table))
        written = range(start // bs, min(len(table), cdiv(end, bs)))
        shared = {i for i in written if pool.ref_count(table[i]) > 1}
        expect_ok = grow + len(shared) <= pool.num_free_blocks
        before = manager_state(mgr)
        ok = mgr.append_slots(request, num_new)
        assert ok == expect_ok
        if not ok:
            assert manager_state(mgr) == before
            return False
        new = mgr.block_table(rid)
        assert len(new) == max(len(table), cdiv(end, bs))
        for i, block_id in enumerate(table):
            if i in shared:
                assert new[i] != block_id and mgr.pins()[block_id] >= 1, "CoW source not pinned"
            else:
                assert new[i] == block_id
        for i in range(start // bs, cdiv(end, bs)):
            assert pool.ref_count(new[i]) == 1, f"block {new[i]} is written while shared"
        self.busy[rid] = num_new
        return True

    @precondition(lambda self: self._appendable())
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._appendable()))
        request = self.live[rid]
        num_left = request.num_tokens - request.num_computed_tokens
        self._append(rid, data.draw(st.integers(1, num_left)))

    @precondition(lambda self: self._cow_candidates())
    @rule(data=st.data())
    def write_into_fork(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._cow_candidates()))
        request = self.live[rid]
        num_left = request.num_tokens - request.num_computed_tokens
        self._append(rid, data.draw(st.integers(1, num_left)))

    @precondition(lambda self: self._twin_writers())
    @rule(data=st.data())
    def write_into_twin(self, data: st.DataObject) -> None:
        """The host copy of the written block goes stale: it must not be reused by a swap."""
        rid = data.draw(st.sampled_from(self._twin_writers()))
        request = self.live[rid]
        num_left = request.num_tokens - request.num_computed_tokens
        self._append(rid, data.draw(st.integers(1, num_left)))

    @precondition(lambda self: self._idle())
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        """More known tokens (a continuation, or speculative tokens) for an idle request."""
        request = self.live[data.draw(st.sampled_from(self._idle()))]
        room = self.max_tokens - request.num_tokens
        if room > 0:
            request.all_token_ids.extend(data.draw(st.lists(TOKENS, min_size=1, max_size=room)))

    # ---- sharing and release ------------------------------------------------------------------

    @precondition(lambda self: self._idle_device())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        mgr = self.m
        parent = self.live[data.draw(st.sampled_from(self._idle_device()))]
        child = make_request(self._new_id(), parent.prompt_token_ids, salt=parent.cache_salt)
        child.all_token_ids = list(parent.all_token_ids)
        last_block = (parent.num_tokens - 1) // self.bs
        if (
            parent.num_computed_tokens < parent.num_tokens
            and len(parent.block_hashes) <= last_block  # never computed (a preempted parent
            and data.draw(st.booleans())  # may have computed and hashed it before)
        ):
            child.all_token_ids[-1] = data.draw(TOKENS)  # the branch sampled its own token
        child.num_computed_tokens = parent.num_computed_tokens
        table = list(mgr.block_table(parent.request_id))
        refs = [mgr.pool.ref_count(b) for b in table]
        mgr.fork(parent, child)
        assert mgr.block_table(child.request_id) == table
        assert mgr.block_table(child.request_id) is not mgr.block_table(parent.request_id)
        assert [mgr.pool.ref_count(b) for b in table] == [r + 1 for r in refs]
        self.live[child.request_id] = child

    @precondition(lambda self: self._idle())
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._idle()))
        self.m.free(rid)
        assert not self.m.has_table(rid) and not self.m.is_swapped(rid)
        self._remember(self.live.pop(rid))

    @precondition(lambda self: self._idle_device())
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        request = self.live[data.draw(st.sampled_from(self._idle_device()))]
        self.m.commit(request)
        self._remember(request)

    # ---- swapping ----------------------------------------------------------------------------

    def _swap_out(self, rid: str) -> bool:
        mgr, host = self.m, self.m.host_pool
        table = list(mgr.block_table(rid))
        host_free = 0 if host is None else host.num_free_blocks
        before = manager_state(mgr)
        if not mgr.swap_out(rid):
            assert len(table) > host_free, "swap_out refused although the host had room"
            assert manager_state(mgr) == before
            return False
        assert host is not None and mgr.is_swapped(rid) and not mgr.has_table(rid)
        assert len(mgr.host_block_table(rid)) == len(table)
        assert host_free - len(table) <= host.num_free_blocks <= host_free
        return True

    def _swap_in(self, rid: str) -> bool:
        mgr = self.m
        host_table = list(mgr.host_block_table(rid))
        free = mgr.pool.num_free_blocks
        before = manager_state(mgr)
        if not mgr.swap_in(rid):
            assert len(host_table) > free, "swap_in refused although the device had room"
            assert manager_state(mgr) == before
            return False
        assert mgr.has_table(rid) and not mgr.is_swapped(rid)
        assert len(mgr.block_table(rid)) == len(host_table)
        return True

    def _preempt_recompute(self, rid: str) -> None:
        request = self.live.pop(rid)
        self.m.free(rid)
        request.num_computed_tokens = 0
        self.waiting.append(request)

    @precondition(lambda self: self._idle_device())
    @rule(data=st.data())
    def preempt_recompute(self, data: st.DataObject) -> None:
        self._preempt_recompute(data.draw(st.sampled_from(self._idle_device())))

    @precondition(lambda self: self._idle_device())
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        self._swap_out(data.draw(st.sampled_from(self._idle_device())))

    @precondition(lambda self: self._sharers())
    @rule(data=st.data())
    def swap_out_sharer(self, data: st.DataObject) -> None:
        """Swap out one of several requests sharing blocks: shared blocks must move once."""
        self._swap_out(data.draw(st.sampled_from(self._sharers())))

    @precondition(lambda self: self._swapped())
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        self._swap_in(data.draw(st.sampled_from(self._swapped())))

    # ---- the step: transfers, writes, commit, sample ------------------------------------------

    def _run_step(self, data: st.DataObject | None) -> None:
        mgr = self.m
        transfers = mgr.take_transfers()
        assert not mgr.pins() and not mgr.host_pins(), "take_transfers left pins behind"
        assert not mgr.take_transfers(), "take_transfers must clear what it hands out"
        # As the tier manager does: a host block is verified before it is written to storage.
        verify = self.m.tier_state.verify_host
        assert verify is not None
        saves = tuple(
            w for w in transfers.saves if not w.on_host or verify(w.block_id, w.block_hash)
        )
        self.kv.apply(dataclasses.replace(transfers, saves=saves))
        self.corrupt -= {h for _, h in transfers.loads} | {h for _, h in transfers.swap_out}
        scheduled = tuple(
            ScheduledRequest(
                self.live[rid], self.live[rid].num_computed_tokens, n, mgr.block_table(rid)
            )
            for rid, n in self.busy.items()
        )
        self.num_steps += 1
        check_plan(mgr, Plan(self.num_steps, scheduled, transfers))
        for s in scheduled:
            for i in range(
                s.start_position // self.bs, cdiv(s.start_position + s.num_tokens, self.bs)
            ):
                block_id = s.block_table[i]
                assert mgr.pool.ref_count(block_id) == 1, f"write into shared block {block_id}"
            self.kv.write(s.block_table, s.request, s.start_position, s.num_tokens)
            request = s.request
            request.num_computed_tokens += s.num_tokens
            mgr.commit(request)
            self._remember(request)
            if (
                data is not None
                and request.num_computed_tokens == request.num_tokens < self.max_tokens
            ):
                request.append_token(data.draw(TOKENS))  # sampled
        self.busy.clear()
        self._check_contents()

    def _check_contents(self) -> None:
        mgr = self.m
        for rid, request in self.live.items():
            n = request.num_computed_tokens
            if mgr.has_table(rid):
                got = self.kv.read(mgr.block_table(rid), n)
            else:
                got = self.kv.read(mgr.host_block_table(rid), n, host=True)
            assert got == expected_history(request), f"{rid} reads someone else's K/V"
        for block_hash, block_id in mgr.pool.index_items():
            assert self.kv.device[block_id] == self.hash_content[block_hash], (
                f"cached block {block_id} does not hold the K/V its hash names"
            )
        if mgr.tier_state.host_caching and mgr.host_pool is not None:
            for block_hash, block_id in mgr.host_pool.index_items():
                if (
                    block_id in self.corrupt
                    or block_id in mgr.pending.swap_out
                    or block_id in mgr.tier_state.pending_loads
                ):
                    continue  # damaged on purpose, or its K/V arrives with the next plan
                assert self.kv.host[block_id] == self.hash_content[block_hash], (
                    f"host-cached block {block_id} does not hold the K/V its hash names"
                )
        for block_hash, content in self.kv.storage.items():
            assert content == self.hash_content[block_hash], "storage holds the wrong K/V"

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self._run_step(data)

    @rule(data=st.data(), chunk=st.integers(1, 4), swap=st.booleans())
    def scheduler_step(self, data: st.DataObject, chunk: int, swap: bool) -> None:
        """One step the way the Scheduler makes it: resume swapped requests while they fit, give
        every running request its next chunk, preempting the newest other one (by swap or by
        recompute) when a chunk does not fit; then run the step."""
        for rid in self._swapped():
            self._swap_in(rid)
        for rid in self._appendable():
            if rid not in self.live or not self.m.has_table(rid):
                continue  # preempted as a victim earlier in this step
            request = self.live[rid]
            num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
            while not self._append(rid, num_new):
                victims = [r for r in self._idle_device() if r != rid]
                if not victims:
                    break
                if not (swap and self._swap_out(victims[-1])):
                    self._preempt_recompute(victims[-1])
        self._run_step(data)

    # ---- checks ------------------------------------------------------------------------------

    @invariant()
    def manager_invariants(self) -> None:
        if self.mgr is not None:
            check_manager(self.mgr)

    def teardown(self) -> None:
        # Hypothesis calls teardown in a ``finally``: after a failed rule, report that failure
        # rather than whatever the half-done cleanup would raise.
        if self.mgr is None or sys.exc_info()[1] is not None:
            return
        self._run_step(None)
        for rid in list(self.live):
            self.mgr.free(rid)
        self.mgr.take_transfers()
        check_no_leak(self.mgr)


TestKVManagerMachine = KVManagerMachine.TestCase
