"""Bad tier configuration at start-up: a clear error or a clear warning, never a half-built engine.

An unknown write policy and a cache directory that cannot be written are errors. An unreachable
store is a warning and the engine runs without that tier, unless the user made it mandatory. A
store that stops answering mid-run (a paused Redis) costs requests no more than recomputing.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.errors import InvalidRequestError
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel
from pagekv.sampling_params import SamplingParams
from tests.tiering.stores import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"cache_write_policy": "write_sometimes"}, "cache_write_policy"),
        ({"kv_store": ""}, "kv_store"),
        ({"kv_store": 42}, "kv_store"),
        ({"host_cache_memory": "lots"}, "host_cache_memory"),
        ({"kv_store_timeout_s": 0}, "kv_store_timeout_s"),
    ],
)
def test_bad_tier_settings_name_the_parameter(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        EngineConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.param == param


@pytest.mark.model
def test_unwritable_cache_directory_is_an_error(loaded: LoadedModel, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(InvalidRequestError, match="not writable"):
        LLMEngine(EngineConfig(num_kv_blocks=16, kv_store=f"file:{not_a_dir}/kv"), loaded)


@pytest.mark.model
def test_unknown_store_scheme_is_an_error(loaded: LoadedModel) -> None:
    with pytest.raises(InvalidRequestError, match="accepted"):
        LLMEngine(EngineConfig(num_kv_blocks=16, kv_store="s3://bucket"), loaded)


@pytest.mark.model
def test_unreachable_store_warns_and_runs_without_it(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    spec = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="pagekv"):
        engine = LLMEngine(EngineConfig(num_kv_blocks=16, kv_store=spec), loaded)
    assert "unreachable" in caplog.text and spec in caplog.text
    assert engine.tiers is not None and engine.tiers.store is None
    params = SamplingParams(temperature=0, max_tokens=2)
    out = LLM.from_engine(engine).generate("Hello", params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(InvalidRequestError, match="required"):
        LLMEngine(EngineConfig(num_kv_blocks=16, kv_store=spec, kv_store_required=True), loaded)


@pytest.mark.model
def test_cli_reports_a_bad_write_policy(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagekv.cli", "generate", "hi", "--max-tokens", "1",
         "--cache-write-policy", "write_sometimes"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 2
    assert "cache_write_policy must be one of" in result.stderr


@pytest.mark.model
def test_a_store_that_stops_answering_costs_no_more_than_recomputing(
    loaded: LoadedModel, redis_server: ServerProcess
) -> None:
    prompt = "Once upon a time " * 40
    greedy = SamplingParams(temperature=0, max_tokens=4)
    expected = (
        LLM.from_engine(LLMEngine(EngineConfig(num_kv_blocks=64), loaded))
        .generate(prompt, greedy, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    config = EngineConfig(
        num_kv_blocks=64, kv_store=f"redis://{redis_server.spec_address}", kv_store_timeout_s=1.0
    )
    engine = LLMEngine(config, loaded)
    llm = LLM.from_engine(engine)
    redis_server.pause()  # SIGSTOP: connections hang instead of failing
    try:
        t0 = time.monotonic()
        got = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        elapsed = time.monotonic() - t0
        assert got == expected
        assert elapsed < 30  # the request waited at most until its deadline (~1 s), not forever
        # The hung call times out in the background. The server stays stopped until then: once
        # resumed, a call still waiting would simply succeed (a race the test must not have).
        deadline = time.monotonic() + 10
        while engine.stats()["storage_errors"] == 0:
            assert time.monotonic() < deadline, "a hung store call was never counted"
            time.sleep(0.1)
        assert engine.stats()["load_give_ups"] + engine.stats()["loads_arrived"] >= 1
    finally:
        redis_server.resume()
        engine.close()
