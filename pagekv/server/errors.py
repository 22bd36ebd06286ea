"""Server errors and the ONE table that maps exception types to HTTP statuses.

Every error leaves as an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``.
Unknown exceptions become 500 with a fixed message: a stack trace is logged, never sent.
"""

from __future__ import annotations

from typing import Any

from pagekv.errors import InvalidRequestError, PagekvError


class AuthenticationError(PagekvError):
    """Missing or wrong API key."""

    code = "invalid_api_key"


class BodyTooLargeError(PagekvError):
    """The request body is larger than ``max_request_body_bytes``."""


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve."""

    code = "model_not_found"


class ModelCardNotFoundError(PagekvError):
    """``GET /v1/models/{id}`` names a model this server does not serve (404)."""

    code = "model_not_found"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(PagekvError):
    """The engine's waiting queue is at ``max_waiting_requests``."""


class ClientLimitError(QueueFullError):
    """One client's requests in flight are at one of its limits (``clients.ClientLimits``)."""

    code = "client_limit"


class RequestTimeoutError(PagekvError):
    """The request body did not arrive within ``body_timeout_s``."""


class UnsupportedMediaTypeError(PagekvError):
    """A JSON endpoint was sent a body that does not say it is JSON."""


class ClientGoneError(PagekvError):
    """The client closed the connection before its request was read or answered."""


class EngineDeadError(PagekvError):
    """The engine thread stopped after an unexpected error; the server cannot generate."""


class RouteNotFoundError(PagekvError):
    """No such path."""


class MethodNotAllowedError(PagekvError):
    """The path exists, the method does not."""


# First match wins: subclasses before their bases.
ERROR_STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (AuthenticationError, 401, "authentication_error"),
    (RequestTimeoutError, 408, "invalid_request_error"),
    (BodyTooLargeError, 413, "invalid_request_error"),
    (UnsupportedMediaTypeError, 415, "invalid_request_error"),
    (QueueFullError, 429, "rate_limit_error"),
    (RouteNotFoundError, 404, "not_found_error"),
    (ModelCardNotFoundError, 404, "invalid_request_error"),
    (MethodNotAllowedError, 405, "invalid_request_error"),
    (InvalidRequestError, 400, "invalid_request_error"),
    (EngineDeadError, 503, "service_unavailable"),
    (ClientGoneError, 499, "client_closed_request"),  # nginx's: nobody reads the answer
)
INTERNAL = (500, "internal_error")


def status_of(exc: BaseException) -> tuple[int, str]:
    """HTTP status and OpenAI error type of an exception."""
    for exc_type, status, kind in ERROR_STATUS:
        if isinstance(exc, exc_type):
            return status, kind
    return INTERNAL


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and JSON body for ``exc``; 500s carry no detail of the exception."""
    status, kind = status_of(exc)
    if status == INTERNAL[0]:  # the server log has the traceback; the client gets nothing of it
        message, param, code = "internal server error", None, None
    else:
        message = str(exc) or type(exc).__name__
        param = getattr(exc, "param", None)
        code = getattr(exc, "code", None)
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}
