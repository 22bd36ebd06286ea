"""Scheduling policy: the order in which requests are served, and who is preempted first.

Owns: each live request's sort key (assigned once, when it enters the scheduler) and the
sequence counter that breaks ties. The scheduler owns the queues; this module only orders them.
Must not import torch.

Every queue is kept in ascending key order: the head is served first, the tail is the first
preemption victim. Keys are static, so a queue never needs re-sorting as time passes:

    fcfs       key = (seq,)                                   arrival order; newest is the victim
    fair       key = (turn, seq)                              clients in turn, each in arrival order
    priority   key = (priority * aging_steps + arrival_step, seq)
               (aging_steps = 0: key = (priority, seq), strict priority, may starve)

Fair turns (``Request.client``, e.g. the address an HTTP request came from): a request's turn
is one past its client's previous live request's, and at least the virtual time V, the lowest
turn of any live request (never decreasing). A client's requests keep their order, and a
newcomer's first request takes turn V: it waits behind at most one request of every other
client, however many that client queued, and the newest request of the client with the most
is the first victim. With a single client (every offline request: client None) turns are
0, 1, 2, ... in arrival order, the same order as fcfs.

Why aging is a static key: a request of priority ``p`` that has waited ``w`` steps is served
as if its priority were ``p - w / aging_steps``. Two requests both age at the same rate, so the
difference between their effective priorities never changes:

    (p1 - (now - a1) / A) - (p2 - (now - a2) / A)  =  (p1 - p2) + (a1 - a2) / A

and ordering by ``p * A + a`` is the same as ordering by effective priority at every moment. A
request of priority ``p`` arriving at step ``a`` is therefore served as if it arrived, at
priority 0, at step ``a + p * A``: any request arriving later than that queues behind it, which
bounds how long a steady stream of more urgent requests can keep it waiting.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Callable, Iterator
from enum import Enum

from pagekv.core.request import Request
from pagekv.errors import InvalidRequestError

SortKey = tuple[int, ...]


class SchedulingPolicy(Enum):
    FCFS = "fcfs"  # first come, first served
    FAIR = "fair"  # clients in turn (Request.client), each first come, first served
    PRIORITY = "priority"  # lower ``Request.priority`` first (as vLLM), aged; then FCFS


def check_priority(priority: object) -> int:
    """A request's priority: any integer, negative allowed (lower is served first)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(
            f"priority must be an integer (lower is served first), got {priority!r}", "priority"
        )
    return priority


class RequestOrder:
    """Assigns every live request its static sort key (see the module docstring).

    Owner of the keys of live requests, by id; ``forget`` drops a finished request's key.
    """

    def __init__(self, policy: SchedulingPolicy, aging_steps: int) -> None:
        self.policy = policy
        self.aging_steps = aging_steps
        self._keys: dict[str, SortKey] = {}
        self._seq = 0
        # Length of a request's own key; a branch appends its own sequence number to its
        # parent's (truncated to this), so keys never grow over generations of beams.
        self._base_len = 1 if policy is SchedulingPolicy.FCFS else 2
        self._turns = FairTurns()

    def register(self, request: Request, arrival_step: int) -> None:
        """Key a request entering the scheduler (``add``) at ``arrival_step``."""
        self._seq += 1
        if self.policy is SchedulingPolicy.FCFS:
            key: SortKey = (self._seq,)
        elif self.policy is SchedulingPolicy.FAIR:
            key = (self._turns.take(request.request_id, request.client), self._seq)
        elif self.aging_steps > 0:
            key = (request.priority * self.aging_steps + arrival_step, self._seq)
        else:
            key = (request.priority, self._seq)
        self._keys[request.request_id] = key

    def register_branch(self, parent: Request, child: Request) -> None:
        """A forked branch (n > 1, or a beam) sorts right after its parent's arrival, before
        anything that arrived later; branches of one parent in the order they were forked."""
        self._seq += 1
        base = self._keys[parent.request_id][: self._base_len]
        self._keys[child.request_id] = (*base, self._seq)

    def forget(self, request_id: str) -> bool:
        """Drop a finished request's key; whether it had one (it entered the scheduler)."""
        self._turns.give_back(request_id)
        return self._keys.pop(request_id, None) is not None

    def key(self, request: Request) -> SortKey:
        return self._keys[request.request_id]


class FairTurns:
    """The fair policy's turns (module docstring): each live request's, each client's last,
    and the virtual time. Owner of them; ``RequestOrder`` asks it."""

    def __init__(self) -> None:
        self._of: dict[str, tuple[str | None, int]] = {}  # live request -> (client, turn)
        self._last: dict[str | None, int] = {}  # client with live requests -> latest turn
        self._live: Counter[str | None] = Counter()  # client -> live requests
        self._count: Counter[int] = Counter()  # turn -> live requests holding it
        self._heap: list[int] = []  # turns held, lazily cleaned (count 0: gone)
        self.virtual_time = 0

    def take(self, request_id: str, client: str | None) -> int:
        live = self._lowest()
        if live is not None:
            self.virtual_time = max(self.virtual_time, live)
        turn = max(self._last.get(client, self.virtual_time - 1) + 1, self.virtual_time)
        self._of[request_id] = (client, turn)
        self._last[client] = turn
        self._live[client] += 1
        if self._count[turn] == 0:
            heapq.heappush(self._heap, turn)
        self._count[turn] += 1
        return turn

    def give_back(self, request_id: str) -> None:
        held = self._of.pop(request_id, None)
        if held is None:
            return
        client, turn = held
        self._count[turn] -= 1
        if self._count[turn] == 0:
            del self._count[turn]
        self._live[client] -= 1
        if self._live[client] == 0:  # no live request: its next one starts at the virtual time
            del self._live[client]
            del self._last[client]

    def _lowest(self) -> int | None:
        heap = self._heap
        while heap and heap[0] not in self._count:
            heapq.heappop(heap)
        return heap[0] if heap else None


class RequestQueue:
    """Requests in ascending key order: ``peek``/``pop`` give the first to serve.

    A plain list with binary insertion: pushes are O(log n) compares plus a memmove, which stays
    far below a step's cost for the thousands of requests a server queues.
    """

    def __init__(self, key: Callable[[Request], SortKey]) -> None:
        self._key = key
        self._items: list[Request] = []

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self._items)

    def push(self, request: Request) -> None:
        bisect.insort(self._items, request, key=self._key)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.pop(0)

    def discard(self, request: Request) -> bool:
        """Remove ``request`` if queued here; whether it was."""
        for i, queued in enumerate(self._items):
            if queued is request:
                del self._items[i]
                return True
        return False
