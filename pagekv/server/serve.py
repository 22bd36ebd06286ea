"""Run the server: engine thread + uvicorn on the main thread, until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import sys

import uvicorn
from fastapi import FastAPI

from pagekv.engine.llm_engine import LLMEngine
from pagekv.server.app import build_app
from pagekv.server.connections import header_deadline_protocol
from pagekv.server.engine_loop import EngineLoop
from pagekv.server.metrics import Metrics
from pagekv.server.settings import ServerConfig
from pagekv.server.state import ServerState
from pagekv.server.vllm_metrics import ServedModel

logger = logging.getLogger("pagekv.server")


def create_app(engine: LLMEngine, config: ServerConfig) -> tuple[FastAPI, EngineLoop]:
    """The app and its (not yet started) engine loop."""
    metrics = Metrics()
    loop = EngineLoop(engine, metrics, config.max_waiting_requests)
    state = ServerState.create(engine, config, loop, metrics)
    metrics.export_vllm_names(ServedModel.of(engine, state.model_name))
    return build_app(state), loop


def _after_a_stalled_stream(record: logging.LogRecord) -> bool:
    """Drop uvicorn's line for a response left unfinished: only a stream given up on for its
    stalled client ends so, and that has its own line (``openai_api.AbortOnClose``)."""
    return record.getMessage() != "ASGI callable returned without completing response."


def serve(engine: LLMEngine, config: ServerConfig) -> None:
    """Serve until interrupted; the engine thread stops after uvicorn does."""
    app, loop = create_app(engine, config)
    logger.setLevel(logging.INFO)  # its one-line notes (timeouts, clients gone) are worth seeing
    logging.getLogger("uvicorn.error").addFilter(_after_a_stalled_stream)
    loop.start()
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(config.graceful_shutdown_s),
        http=header_deadline_protocol(config.header_timeout_s),
        timeout_keep_alive=max(1, round(config.keep_alive_timeout_s)),
    )
    server = uvicorn.Server(uv_config)
    print(
        f"pagekv: serving {app.state.pagekv.model_name} on http://{config.host}:{config.port}",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.run()
    finally:
        loop.stop()
        engine.close()  # finish writing to the storage tier
