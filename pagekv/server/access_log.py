"""One line per HTTP response, as uvicorn's access log has it plus the time taken:

    127.0.0.1:51234 - "POST /v1/completions HTTP/1.1" 200 OK 35.1 ms

An ASGI middleware around the app, so every response has its line, errors included (a 400 or
404 answered by the app, a 500 from an exception that escapes it). A stream's line comes when
it ends. Logged at info on ``pagekv.access``, whose level follows ``--uvicorn-log-level``.
"""

from __future__ import annotations

import http
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("pagekv.access")


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:  # 499: nginx's, not in the standard's list
        return "Client Closed Request" if status == 499 else ""


class AccessLog:
    """The ASGI middleware; owns nothing but the wrapped app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not logger.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 0

        async def noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_status)
        except Exception:
            status = status or 500  # the error middleware outside answers it
            raise
        finally:
            self._line(scope, status, time.monotonic() - start)

    @staticmethod
    def _line(scope: Scope, status: int, seconds: float) -> None:
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "-"
        request = f"{scope['method']} {scope['path']} HTTP/{scope.get('http_version', '1.1')}"
        shown = status or 499  # no response started: the client left first
        logger.info(
            '%s - "%s" %d %s %.1f ms', where, request, shown, _phrase(shown), seconds * 1000
        )
