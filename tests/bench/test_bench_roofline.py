"""The roofline's counts against a step-by-step count and the real model, and its measurements."""

from __future__ import annotations

import argparse

import pytest

from pagekv.bench import register, roofline, roofline_report
from pagekv.bench.workloads import BenchRequest, Workload, load_workload
from pagekv.kernels import build, isa
from pagekv.models.config import ModelConfig
from pagekv.models.loader import LoadedModel, read_config

TINY = ModelConfig(
    model_type="llama",
    vocab_size=100,
    hidden_size=8,
    intermediate_size=12,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    attention_bias=False,
)


def step_by_step(
    config: ModelConfig, workload: Workload, width: int, share: bool
) -> dict[str, float]:
    """The same least work, counted one token and one step at a time."""
    c = config
    matmul = c.num_hidden_layers * (
        c.hidden_size * (c.q_size + 2 * c.kv_size)
        + c.q_size * c.hidden_size
        + 2 * c.hidden_size * c.intermediate_size
        + c.intermediate_size * c.hidden_size
    )
    head = c.hidden_size * c.vocab_size
    pair = c.num_hidden_layers * 2 * c.num_attention_heads * c.head_dim
    prompts = [r.prompt_token_ids for r in workload.requests]
    shared = 0
    if share:
        while all(len(p) > shared and p[shared] == prompts[0][shared] for p in prompts):
            shared += 1
    prefill = attention = 0
    for i, prompt in enumerate(prompts):
        for position in range(0 if i == 0 else shared, len(prompt)):
            prefill += matmul
            attention += pair * (position + 1)
        prefill += head  # its first output token
    decode = positions = steps = 0
    for t in range(1, max(r.output_len for r in workload.requests)):
        live = [(len(r.prompt_token_ids), r) for r in workload.requests if r.output_len > t]
        if not live:
            break
        steps += 1
        for n, _ in live:
            decode += matmul + head
            attention += pair * (n + t)
        positions += sum(n + t for n, _ in live) - shared * (len(live) - 1)
    weights = (matmul + head) * width
    return {
        "prefill": 2.0 * prefill,
        "decode": 2.0 * decode,
        "attention": 2.0 * attention,
        "weights": float((steps + 1) * weights),
        "kv": float(positions * c.num_hidden_layers * 2 * c.kv_size * width),
        "steps": steps,
    }


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_count_work_matches_a_step_by_step_count(share: bool, dtype: str) -> None:
    workload = Workload(
        "mixed",
        [
            BenchRequest([5, 6, 7, 8, 9], 4),
            BenchRequest([5, 6, 7, 1], 1),
            BenchRequest([5, 6, 7, 8, 2, 3, 4], 7),
            BenchRequest([5, 6, 7], 2),
        ],
    )
    work = roofline.count_work(TINY, workload, dtype, share_prefix=share)
    expected = step_by_step(TINY, workload, roofline.DTYPE_BYTES[dtype], share)
    assert work.prefill_matmul_flops == expected["prefill"]
    assert work.decode_matmul_flops == expected["decode"]
    assert work.attention_flops == expected["attention"]
    assert work.weight_bytes == expected["weights"]
    assert work.kv_bytes == expected["kv"]
    assert work.decode_steps == expected["steps"] == 6
    assert work.output_tokens == 14


def test_count_work_on_the_standard_workloads() -> None:
    config = read_config()
    for name in ("random", "prefix"):
        workload = load_workload(name)
        work = roofline.count_work(config, workload, "bfloat16")
        expected = step_by_step(config, workload, 2, True)
        assert (work.prefill_matmul_flops, work.kv_bytes) == (expected["prefill"], expected["kv"])
    # the prefix workload's 256 shared positions are computed once and read once a step
    prefix = load_workload("prefix")
    shared = roofline.count_work(config, prefix, "bfloat16", share_prefix=True)
    alone = roofline.count_work(config, prefix, "bfloat16", share_prefix=False)
    assert roofline.common_prefix_len([r.prompt_token_ids for r in prefix.requests]) == 256
    assert alone.prefill_matmul_flops - shared.prefill_matmul_flops == pytest.approx(
        63 * 256 * (alone.prefill_matmul_flops / (64 * 288)), rel=0.02
    )
    assert alone.kv_bytes > 4 * shared.kv_bytes


def test_weights_fitting_in_cache_are_read_once() -> None:
    workload = Workload("one", [BenchRequest([1, 2], 5)])
    streamed = roofline.count_work(TINY, workload, "float32", cache_bytes=0)
    cached = roofline.count_work(TINY, workload, "float32", cache_bytes=1 << 30)
    assert streamed.weight_bytes == 5 * cached.weight_bytes  # 4 decode steps + the prefill


@pytest.mark.model
def test_weights_are_the_models_matmul_weights(loaded: LoadedModel) -> None:
    # every 2-D parameter is a matmul's weight; the embedding table is the (tied) LM head
    params = dict(loaded.model.named_parameters())
    assert "lm_head" not in params and loaded.config.tie_word_embeddings
    matmul = sum(p.numel() for p in params.values() if p.dim() == 2)
    work = roofline.count_work(loaded.config, Workload("one", [BenchRequest([1], 2)]), "float32")
    assert work.weight_bytes == 2 * 4 * matmul  # read for the prefill and for one decode step
    assert work.decode_matmul_flops == 2 * matmul


def test_common_prefix_len() -> None:
    assert roofline.common_prefix_len([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert roofline.common_prefix_len([[1, 2], [1, 2]]) == 2
    assert roofline.common_prefix_len([[3], [1, 2]]) == 0
    assert roofline.common_prefix_len([[1, 2]]) == 0


def test_floor_is_the_slower_of_compute_and_memory() -> None:
    work = roofline.Work(4e12, 2e12, 0.0, 30e9, 30e9, 10, 1000)
    fast_memory = roofline.Peaks(2, 200e9, 400e9, 600e9)
    slow_memory = roofline.Peaks(2, 200e9, 400e9, 1e9)
    assert roofline.floor_seconds(work, fast_memory, "float32") == pytest.approx(30.0)
    assert roofline.floor_seconds(work, fast_memory, "bfloat16") == pytest.approx(15.0)
    assert roofline.floor_seconds(work, slow_memory, "bfloat16") == pytest.approx(60.0)
    assert roofline.floor_seconds(work, roofline.Peaks(2, 1e9, None, 1e9), "bfloat16") is None
    text = roofline.format_roofline(work, fast_memory, "bfloat16", "t", 50.0, 40.0)
    assert "floor (compute and memory fully overlapped" in text and "15.00 s" in text
    assert "target 50.0 tok/s: 20.00 s a pass, 1.33x the floor" in text
    assert "measured 40.0 tok/s: 25.00 s a pass, 1.67x the floor" in text


@pytest.mark.skipif(build.find_compiler() is None, reason="needs a C++ compiler")
def test_measured_peaks_and_the_command() -> None:
    """float32 FMAs and reads are measured on every kernel target (at its vector width), bf16
    dot products only where the target has them."""
    peaks = roofline.measure_peaks(threads=1, repeats=2)
    assert peaks.f32_flops is not None and peaks.read_bytes is not None
    assert 1e9 < peaks.f32_flops < 1e13 and 1e8 < peaks.read_bytes < 1e12
    target = isa.selected() or isa.best()
    if target in ("avx512bf16", "amx") and not peaks.note:
        assert peaks.bf16_flops is not None
    if peaks.bf16_flops is not None:  # a bf16 dot product does twice a float32 FMA's work
        assert peaks.bf16_flops > 1.2 * peaks.f32_flops
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "roofline", "--workload", "prefix", "--num-threads", "1", "--target", "100"]
    )
    text = roofline_report(args, load_workload("prefix"))
    assert "roofline: prefix, float32, 30 layers x 576, 64 requests" in text
    assert "target 100.0 tok/s" in text and "| K/V histories |" in text
