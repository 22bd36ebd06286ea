"""``OutputStream``: the event-loop side of one HTTP request's engine requests.

Owns the outputs not yet read by the handler. Bounded: at most ONE pending output per engine
request. Engine outputs are cumulative (text and token ids so far), so a newer output replaces
a pending older one without losing anything but an intermediate delta; a client that never
reads holds a few objects, never a growing queue, and never blocks the engine thread.

Only the event loop thread calls these methods (the engine thread goes through
``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from pagekv.engine.outputs import RequestOutput


class OutputStream:
    """Cumulative outputs of the engine requests ``request_ids`` (one per prompt)."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = list(request_ids)
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._pending: OrderedDict[str, RequestOutput] = OrderedDict()
        self._unfinished = set(self.request_ids)
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.num_coalesced = 0  # outputs replaced before the handler read them
        self.latest: dict[int, RequestOutput] = {}  # prompt index -> last output read

    @property
    def finished(self) -> bool:
        """Every engine request delivered its final output to the handler."""
        return not self._unfinished and not self._pending

    @property
    def unfinished_request_ids(self) -> list[str]:
        return [rid for rid in self.request_ids if rid in self._unfinished]

    def put(self, output: RequestOutput) -> None:
        if output.request_id in self._pending:
            self.num_coalesced += 1
        self._pending[output.request_id] = output  # replaces in place: order of first arrival
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def get(self) -> tuple[int, RequestOutput]:
        """The next output and the index of its prompt; raises the stream's error, if any."""
        while not self._pending:
            if self._error is not None:
                raise self._error
            self._event.clear()
            await self._event.wait()
        rid, output = self._pending.popitem(last=False)
        if output.finished:
            self._unfinished.discard(rid)
        index = self._index[rid]
        self.latest[index] = output
        return index, output

    async def finals(self) -> list[RequestOutput]:
        """Wait for every engine request to finish; their last outputs in prompt order."""
        while not self.finished:
            await self.get()
        return [self.latest[i] for i in range(len(self.request_ids))]
