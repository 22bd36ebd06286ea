"""The requests of a run that have not arrived yet, for both simulators (paged and contiguous).

Owns the arrival order: requests by arrival time (ties in the order given), and requests that
follow another (a chat's next turn), held until that one ends or is rejected and then due
their own ``arrival_s`` later (the user's think time).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

from pagekv.sim.workload import SimRequest


class ArrivalQueue:
    """Requests not yet handed to a run; ``release`` starts a finished request's followers."""

    def __init__(self, requests: Sequence[SimRequest]) -> None:
        self._heap: list[tuple[float, int, SimRequest]] = []
        self._followers: dict[str, list[SimRequest]] = {}
        self._pushed = 0
        for request in requests:
            if request.follows is None:
                self._push(request, request.arrival_s)
            else:
                self._followers.setdefault(request.follows, []).append(request)

    def __bool__(self) -> bool:
        """Whether a request is due now or later (held followers do not count)."""
        return bool(self._heap)

    def next_s(self) -> float:
        """When the next request is due; only while there is one."""
        return self._heap[0][0]

    def due(self, clock_s: float) -> Iterator[tuple[float, SimRequest]]:
        """(arrival time, request) of every request due by ``clock_s``, earliest first,
        including any that ``release`` makes due while this is being consumed."""
        while self._heap and self._heap[0][0] <= clock_s:
            at_s, _, request = heapq.heappop(self._heap)
            yield at_s, request

    def release(self, request_id: str, clock_s: float) -> None:
        """``request_id`` ended (or was turned away) at ``clock_s``: its followers are due
        their think time after that."""
        for follower in self._followers.pop(request_id, []):
            self._push(follower, clock_s + follower.arrival_s)

    def _push(self, request: SimRequest, at_s: float) -> None:
        self._pushed += 1
        heapq.heappush(self._heap, (at_s, self._pushed, request))
