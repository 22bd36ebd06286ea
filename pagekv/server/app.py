"""The FastAPI app: /v1 routes, /health, /metrics, /debug/kv, and the error handlers.

``build_app`` wires a started-or-not ``EngineLoop`` into a fresh app; every error, whatever
raised it, leaves through ``errors.error_body`` (one table from exception type to status).
With an API key set, /v1 and /debug need it (and /metrics with ``metrics_require_key``);
/health never does. The debug pages show prefix hashes keyed by the server's secret.
Around the routes: the access log (a line per response), CORS when origins are allowed, and
while the app runs, the periodic stats line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from pagekv.engine.llm_engine import LLMEngine
from pagekv.errors import InvalidRequestError, PagekvError
from pagekv.server.access_log import AccessLog
from pagekv.server.engine_loop import EngineLoop
from pagekv.server.errors import (
    EngineDeadError,
    MethodNotAllowedError,
    RouteNotFoundError,
    error_body,
)
from pagekv.server.handling import require_api_key, state_of
from pagekv.server.kv_page import render_kv_page
from pagekv.server.metrics import Metrics
from pagekv.server.openai_api import router
from pagekv.server.responses_api import responses_router
from pagekv.server.state import ServerState
from pagekv.server.stats_log import log_stats
from pagekv.server.utility_api import utility_router
from pagekv.server.worker_api import worker_router

METRICS_WAIT_S = 1.0  # how long /metrics waits for the engine's step boundary

logger = logging.getLogger("pagekv.server")


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(
        title="pagekv",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        root_path=state.config.root_path,
        lifespan=_lifespan,
    )
    app.state.pagekv = state
    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(utility_router)
    app.include_router(worker_router)
    keyed = [Depends(require_api_key)]
    app.add_api_route("/health", health, methods=["GET"])
    metrics_keyed = keyed if state.config.metrics_require_key else []
    app.add_api_route("/metrics", metrics, methods=["GET"], dependencies=metrics_keyed)
    app.add_api_route("/debug/kv", kv_page, methods=["GET"], dependencies=keyed)
    app.add_api_route("/debug/kv.json", kv_json, methods=["GET"], dependencies=keyed)
    # PagekvError (every 4xx, and 503) is answered by the exception middleware; anything else
    # reaches the outermost handler, which answers 500 and lets uvicorn log the traceback.
    app.add_exception_handler(PagekvError, _any_exception)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(Exception, _any_exception)
    cors = state.config.cors
    if cors.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
            allow_credentials=cors.allow_credentials,
        )
    if state.config.logs.access_log:
        app.add_middleware(AccessLog)  # outermost of ours: every response has its line
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """While the app runs: the periodic stats line (unless --disable-log-stats)."""
    state: ServerState = app.state.pagekv
    logs = state.config.logs
    task = (
        asyncio.create_task(log_stats(state.loop, logs.stats_interval_s))
        if logs.log_stats
        else None
    )
    try:
        yield
    finally:
        if task is not None:
            task.cancel()


def _error_response(request: Request, exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    state_of(request).metrics.error(status)
    if status in (408, 499):  # the client's doing, not the server's: one line
        client = request.client.host if request.client is not None else "unknown"
        logger.info("%d %s %s %s: %s", status, client, request.method, request.url.path, exc)
    return JSONResponse(body, status_code=status)


async def _any_exception(request: Request, exc: Exception) -> Response:
    return _error_response(request, exc)


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own routing errors (no such path or method), through the same table."""
    assert isinstance(exc, StarletteHTTPException)
    kinds: dict[int, type[PagekvError]] = {404: RouteNotFoundError, 405: MethodNotAllowedError}
    error_type = kinds.get(exc.status_code, InvalidRequestError)
    return _error_response(
        request, error_type(f"{request.method} {request.url.path}: {exc.detail}")
    )


async def health(request: Request) -> Response:
    if not state_of(request).loop.alive:
        return _error_response(request, EngineDeadError("the engine thread is not running"))
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = state_of(request)
    stats = await stats_for_scrape(state.loop, state.metrics)
    return Response(state.metrics.exposition(stats), media_type=CONTENT_TYPE_LATEST)


async def stats_for_scrape(
    loop: EngineLoop, metrics: Metrics, wait_s: float = METRICS_WAIT_S
) -> Mapping[str, Any]:
    """The engine's numbers as of its next step boundary; if a long step (a deep prefill) holds
    that up past ``wait_s``, the previous scrape's engine numbers (the counters the HTTP side
    keeps are current either way), so a scraper's timeout never fails a scrape."""
    fresh = asyncio.ensure_future(loop.call(lambda engine: engine.stats()))
    fresh.add_done_callback(lambda f: f.cancelled() or f.exception())  # a late error: seen
    latest = metrics.latest_stats
    if latest is None:
        return await fresh
    try:
        return await asyncio.wait_for(asyncio.shield(fresh), wait_s)
    except TimeoutError:
        return latest


async def kv_page(request: Request) -> Response:
    """The block map page, with the current map inlined so it draws without a fetch."""
    return HTMLResponse(render_kv_page(await _kv_data(request)))


async def kv_json(request: Request) -> Response:
    return JSONResponse(await _kv_data(request))


async def _kv_data(request: Request) -> dict[str, Any]:
    state = state_of(request)
    data: dict[str, Any] = await state.loop.call(_block_map_and_stats)
    for block in data["blocks"]:
        if block["hash"] is not None:
            block["hash"] = state.shown_hash(block["hash"])
    data["model"] = state.model_name
    return data


def _block_map_and_stats(engine: LLMEngine) -> dict[str, Any]:
    data = engine.block_map()
    data["stats"] = engine.stats()
    return data
