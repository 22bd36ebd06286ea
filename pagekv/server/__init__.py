"""The OpenAI-compatible HTTP server: completions, chat, metrics and a live KV block map.

Talks only to the engine (tests/structure/test_layers.py enforces it). One engine thread owns
the ``LLMEngine``; HTTP handlers on the asyncio loop send it commands through a thread-safe
queue and read results from per-request ``OutputStream``s fed with
``loop.call_soon_threadsafe``.

    HTTP handler --(EngineRequest, abort, call)--> queue --> engine thread: step() loop
    HTTP handler <--(RequestOutput, cumulative)--- OutputStream <--call_soon_threadsafe--'

Modules: ``settings`` (ServerConfig), ``errors`` (exception -> HTTP status table), ``streams``
(bounded coalescing output queue), ``engine_loop`` (the thread), ``metrics`` (Prometheus),
``protocol`` (request bodies), ``formats`` (response bodies), ``openai_api`` (the /v1 routes),
``worker_api`` (the routes a router calls: load, server info, a generation probe, cache
flush), ``app`` (the FastAPI app), ``kv_page`` and ``kv_png`` (the block map), ``serve``
(uvicorn).
"""

from pagekv.server.settings import ServerConfig

__all__ = ["ServerConfig"]
