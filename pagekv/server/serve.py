"""Run the server: engine thread + uvicorn on the main thread, until SIGINT/SIGTERM.

``bind`` takes the port before the model loads (a port in use fails at once, not after the
model has loaded); ``serve`` hands that socket to uvicorn.
"""

from __future__ import annotations

import logging
import socket

import uvicorn
from fastapi import FastAPI

from pagekv.engine.llm_engine import LLMEngine
from pagekv.errors import PagekvError
from pagekv.server.app import build_app
from pagekv.server.connections import header_deadline_protocol
from pagekv.server.engine_loop import EngineLoop
from pagekv.server.metrics import Metrics
from pagekv.server.settings import ServerConfig
from pagekv.server.state import RenderChat, ServerState
from pagekv.server.vllm_metrics import ServedModel

logger = logging.getLogger("pagekv.server")
UVICORN_TRACE = 5  # uvicorn's "trace" level, below DEBUG
BACKLOG = 2048  # uvicorn's default


class PortInUseError(PagekvError):
    """The address to listen on is taken (or cannot be bound)."""


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, or PortInUseError naming it. It listens at once,
    so no other server can take the port while the model loads (connections made meanwhile
    wait in its backlog until the app starts)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as exc:
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise PortInUseError(
            f"cannot listen on {host}:{port}: {exc.strerror} (another server there? choose "
            "another --port)"
        ) from None
    sock.set_inheritable(True)
    return sock


def create_app(
    engine: LLMEngine, config: ServerConfig, render_chat: RenderChat | None = None
) -> tuple[FastAPI, EngineLoop]:
    """The app and its (not yet started) engine loop."""
    metrics = Metrics()
    loop = EngineLoop(engine, metrics, config.max_waiting_requests)
    state = ServerState.create(engine, config, loop, metrics, render_chat)
    metrics.export_vllm_names(ServedModel.of(engine, state.model_name))
    return build_app(state), loop


def _after_a_stalled_stream(record: logging.LogRecord) -> bool:
    """Drop uvicorn's line for a response left unfinished: only a stream given up on for its
    stalled client ends so, and that has its own line (``openai_api.AbortOnClose``)."""
    return record.getMessage() != "ASGI callable returned without completing response."


def _log_levels(config: ServerConfig) -> None:
    """pagekv's server lines at info; the access lines follow --uvicorn-log-level, as
    uvicorn's own access log does in vLLM."""
    logger.setLevel(logging.INFO)
    level = config.logs.uvicorn_log_level
    access = UVICORN_TRACE if level == "trace" else logging.getLevelName(level.upper())
    logging.getLogger("pagekv.access").setLevel(access)
    logging.getLogger("uvicorn.error").addFilter(_after_a_stalled_stream)


def serve(
    engine: LLMEngine,
    config: ServerConfig,
    sock: socket.socket | None = None,
    render_chat: RenderChat | None = None,
) -> None:
    """Serve on ``sock`` (else a socket bound now) until interrupted; the engine thread stops
    after uvicorn does. ``render_chat``: the chat template (None: the model's)."""
    sock = sock if sock is not None else bind(config.host, config.port)
    app, loop = create_app(engine, config, render_chat)
    _log_levels(config)
    loop.start()
    uv_config = uvicorn.Config(
        app,
        log_level=config.logs.uvicorn_log_level,
        access_log=False,  # the app's own line per response (access_log.py)
        timeout_graceful_shutdown=int(config.graceful_shutdown_s),
        http=header_deadline_protocol(config.header_timeout_s),
        timeout_keep_alive=max(1, round(config.keep_alive_timeout_s)),
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
    )
    server = uvicorn.Server(uv_config)
    host, port = sock.getsockname()[:2]
    scheme = "https" if config.use_tls else "http"
    logger.info("serving %s on %s://%s:%d", app.state.pagekv.model_name, scheme, host, port)
    try:
        server.run(sockets=[sock])
    finally:
        loop.stop()
        engine.close()  # finish writing to the storage tier
        sock.close()
