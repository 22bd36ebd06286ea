"""pagekv.engine.args: the command-line options every engine-building command shares, read back
into an ``EngineConfig``; and the engine's thread setting."""

from __future__ import annotations

import argparse

import pytest
import torch

from pagekv.engine import LLMEngine
from pagekv.engine.args import add_engine_arguments, engine_config
from pagekv.engine.config import EngineConfig
from pagekv.errors import InvalidRequestError
from pagekv.models.loader import LoadedModel


def _parse(argv: list[str], **kwargs: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="random")  # a command's own option
    add_engine_arguments(parser, **kwargs)  # type: ignore[arg-type]
    return parser.parse_args(argv)


def test_every_option_lands_in_its_field() -> None:
    args = _parse(
        [
            "--dtype=bfloat16",
            "--block-size=32",
            "--kv-cache-memory=3GiB",
            "--num-threads=2",
            "--no-enable-prefix-caching",
            "--max-num-seqs=8",
            "--preemption-mode=swap",
            "--swap-space=1GiB",
            "--kv-store=file:/tmp/kv",
            "--cache-write-policy=write_back",
            "--prefill-step-seconds=0.25",
        ]
    )
    config = engine_config(args, trace="t.jsonl")
    assert (config.dtype, config.block_size, config.kv_cache_memory) == ("bfloat16", 32, "3GiB")
    assert (config.num_threads, config.enable_prefix_caching, config.max_num_seqs) == (2, False, 8)
    assert (config.preemption_mode, config.swap_space) == ("swap", "1GiB")
    assert (config.kv_store, config.cache_write_policy) == ("file:/tmp/kv", "write_back")
    assert config.prefill_step_seconds == 0.25
    assert config.trace == "t.jsonl"  # an override for a field no option defines


def test_defaults_are_the_configs_except_where_a_command_says() -> None:
    plain = engine_config(_parse([]))
    assert plain == EngineConfig(swap_space="0", host_cache_memory="0")  # "0": the CLI's text
    bench = _parse([], kv_cache_memory="2GiB", tiers=False)
    assert not hasattr(bench, "kv_store")
    assert engine_config(bench).kv_cache_memory == "2GiB"
    served = engine_config(_parse([], prefill_step_seconds=0.5))  # as `pagekv serve` says
    assert served.prefill_step_seconds == 0.5


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), True, "1"])
def test_bad_step_targets_are_refused(value: object) -> None:
    with pytest.raises(InvalidRequestError, match="prefill_step_seconds"):
        EngineConfig(prefill_step_seconds=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_bad_thread_counts_are_refused(value: object) -> None:
    with pytest.raises(InvalidRequestError, match="num_threads"):
        EngineConfig(num_threads=value)  # type: ignore[arg-type]


@pytest.mark.model
def test_the_engine_sets_its_threads(loaded: LoadedModel) -> None:
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            LLMEngine(EngineConfig(num_threads=threads, kv_cache_memory="8MiB"), loaded)
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
