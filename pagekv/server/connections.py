"""Connections that cannot be held open for free: uvicorn's h11 protocol with a header deadline.

uvicorn closes a kept-alive connection that stays idle after a response, but waits forever for
the headers of a request: a client that opens connections and sends nothing, or a header line
a byte at a time, holds them all. Here every connection must have sent a request's complete
headers ``header_timeout_s`` after it opened, or after its previous response ended; otherwise
it is closed. (The body's own deadline is the handler's: ``openai_api.read_body``.)

Each connection's kernel send buffer is fixed at ``SEND_BUFFER_BYTES`` rather than grown by
the kernel's autotuning (to megabytes): a stream whose client reads nothing then fills it
within a few hundred tokens, uvicorn's writes wait, and the stream's stall deadline
(``openai_api.AbortOnClose``) can see it. Answers and streams of this API are small; the
buffer still covers a fast link's round trip.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

SEND_BUFFER_BYTES = 64 << 10


def header_deadline_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's ``Config(http=...)``: H11Protocol with this header deadline."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request's headers are due

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol
