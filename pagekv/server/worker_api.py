"""The routes a router calls on its workers, in the shapes vllm-router 0.1.17 reads them.

``/get_load`` (and ``/load``): requests in the engine (running, waiting or swapped out), the
number its ``power_of_two`` policy compares (``{"load": N}``). ``/get_server_info``,
``/server_info`` (vLLM's shape) and ``/get_model_info`` (``/model_info``): the served model,
its KV block size and context (a router reads ``model_id`` and ``kv_block_size``).
``/health_generate``: a one-token greedy request through the engine, so a wedged engine fails
it where ``/health`` (the thread is alive) would not. ``/kv_event_sources``: the engine's KV
event publisher (``--kv-events-config``), which a ``kv_aware`` router subscribes to.
``/flush_cache``: forget every cached KV block no request holds (device and host pools; the
storage tier keeps its copies); like every route that changes state it needs the API key when
one is set. The read-only routes are open, as ``/health`` is: a router's probes carry no key.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pagekv.engine.llm_engine import LLMEngine
from pagekv.sampling_params import SamplingParams
from pagekv.server.engine_loop import EngineRequest
from pagekv.server.errors import EngineDeadError
from pagekv.server.handling import require_api_key, state_of

worker_router = APIRouter()
HEALTH_GENERATE_TIMEOUT_S = 30.0
_probe_ids = itertools.count()


def _load(engine: LLMEngine) -> dict[str, int]:
    stats = engine.stats()
    counts = {key: int(stats[key]) for key in ("num_running", "num_waiting", "num_swapped")}
    return {"load": sum(counts.values()), **counts}


def _facts(engine: LLMEngine) -> dict[str, Any]:
    return {
        "model_path": str(engine.loaded.path),
        "kv_block_size": engine.config.block_size,
        "max_model_len": engine.max_model_len,
        "num_kv_blocks": int(engine.stats()["kv_blocks_total"]),
    }


@worker_router.get("/get_load")
@worker_router.get("/load")
async def get_load(request: Request) -> Response:
    return JSONResponse(await state_of(request).loop.call(_load))


@worker_router.get("/get_server_info")
async def get_server_info(request: Request) -> Response:
    state = state_of(request)
    facts = await state.loop.call(_facts)
    return JSONResponse(
        {"model_id": state.model_name, "served_model_names": list(state.model_names), **facts}
    )


@worker_router.get("/server_info")
async def server_info(request: Request) -> Response:
    """vLLM's form (``vllm_config`` as JSON, the parts a router reads), beside the facts."""
    state = state_of(request)
    facts = await state.loop.call(_facts)
    vllm_config = {
        "model_config": {"model": state.model_name, "max_model_len": facts["max_model_len"]},
        "cache_config": {"block_size": facts["kv_block_size"]},
    }
    return JSONResponse({"vllm_config": vllm_config, "model_id": state.model_name, **facts})


@worker_router.get("/get_model_info")
@worker_router.get("/model_info")
async def get_model_info(request: Request) -> Response:
    state = state_of(request)
    facts = await state.loop.call(_facts)
    return JSONResponse(
        {
            "model_id": state.model_name,
            "model_path": facts["model_path"],
            "tokenizer_path": facts["model_path"],
            "is_generation": True,
            "max_model_len": facts["max_model_len"],
        }
    )


@worker_router.get("/kv_event_sources")
async def kv_event_sources(request: Request) -> Response:
    """Where the engine publishes KV events, per rank (vLLM's shape); {} when it does not."""
    return JSONResponse(await state_of(request).loop.call(lambda e: e.kv_event_sources()))


@worker_router.post("/flush_cache", dependencies=[Depends(require_api_key)])
async def flush_cache(request: Request) -> Response:
    num_blocks = await state_of(request).loop.call(lambda engine: engine.reset_prefix_cache())
    return JSONResponse({"flushed_blocks": num_blocks})


@worker_router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once a one-token request has come back from the engine; else the error's status."""
    state = state_of(request)
    bos = state.tokenizer.bos_token_id
    prompt = [bos if bos is not None else 0]
    probe = EngineRequest(
        f"health-{next(_probe_ids)}", prompt, SamplingParams(temperature=0, max_tokens=1)
    )
    stream = await state.loop.add([probe])
    try:
        finals = await asyncio.wait_for(stream.finals(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError as exc:
        state.loop.abort([probe.request_id])
        raise EngineDeadError(
            f"no token from the engine in {HEALTH_GENERATE_TIMEOUT_S:.0f} s"
        ) from exc
    return JSONResponse({"status": "ok", "num_tokens": len(finals[0].outputs[0].token_ids)})
