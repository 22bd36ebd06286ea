"""The engine and offline API as a user meets them: bad input, abort, stop strings, n, chat, CLI."""

from __future__ import annotations

import argparse
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagekv import InvalidRequestError, SamplingParams
from pagekv.core.invariants import check_manager, check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.errors import ModelLoadError, PromptTooLongError
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel

pytestmark = pytest.mark.model


@pytest.fixture
def llm(loaded: LoadedModel) -> LLM:
    engine = LLMEngine(EngineConfig(num_kv_blocks=256, check_invariants=True), loaded)
    return LLM.from_engine(engine)


GREEDY = SamplingParams(temperature=0, max_tokens=8)


def assert_untouched(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["num_waiting"] == stats["num_running"] == 0
    assert not llm.engine.has_unfinished_requests()
    check_manager(llm.engine.kv)


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ("", GREEDY, "prompt"),
        ({"prompt_token_ids": []}, GREEDY, "prompt"),
        ({"prompt_token_ids": [1, -5]}, GREEDY, "prompt"),
        ({"prompt_token_ids": [10**9]}, GREEDY, "prompt"),
        ({"prompt_token_ids": [504, 1.5]}, GREEDY, "prompt"),
        ({"prompt_token_ids": [True, 504]}, GREEDY, "prompt"),
        ({"prompt_token_ids": 504}, GREEDY, "prompt"),
        (None, GREEDY, "prompt"),
        ("hello " * 9000, GREEDY, "prompt"),
    ],
)
def test_bad_prompts_raise_typed_errors_and_leave_nothing(
    llm: LLM, prompt: object, params: SamplingParams, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(prompt, params, use_tqdm=False)  # type: ignore[arg-type]
    assert info.value.param == param
    assert_untouched(llm)
    # ... and the engine keeps serving.
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    vocab = llm.engine.loaded.config.vocab_size
    for ids in ([vocab], [0, 10**12]):
        params = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=ids)
        with pytest.raises(InvalidRequestError) as info:
            llm.generate("Hello", params, use_tqdm=False)
        assert info.value.param == "stop_token_ids"
        assert_untouched(llm)
    last = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[vocab - 1])
    assert llm.generate("Hello", last, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 10**400}, "temperature"),  # no float holds it
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": float("-inf")}, "presence_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": 10**400}, "repetition_penalty"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"seed": 2**64}, "seed"),  # beyond what a torch.Generator takes: it failed mid-step
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param
    assert param in str(info.value)


def test_numpy_token_ids_are_token_ids(llm: LLM) -> None:
    ids = [504, 3458, 314]
    plain = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    for given in (np.array(ids), [np.int32(t) for t in ids]):
        out = llm.generate({"prompt_token_ids": given}, GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids and type(out.prompt_token_ids[0]) is int
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_seeds_at_both_ends_of_the_range_sample(llm: LLM) -> None:
    for seed in (-(2**63), 2**64 - 1):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=3)
        twice = [llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].text for _ in "ab"]
        assert twice[0] == twice[1]


def test_prompt_beyond_pool_is_rejected_before_allocation(loaded: LoadedModel) -> None:
    engine = LLMEngine(EngineConfig(num_kv_blocks=4, block_size=16, check_invariants=True), loaded)
    llm = LLM.from_engine(engine)
    with pytest.raises(PromptTooLongError):
        llm.generate("word " * 80, GREEDY, use_tqdm=False)
    assert_untouched(llm)
    assert engine.stats()["rejected_requests"] == 1


def test_one_bad_prompt_in_a_batch_leaves_nothing_behind(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", "also fine", ""], GREEDY, use_tqdm=False)
    assert_untouched(llm)


def test_abort_mid_generation_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=200, ignore_eos=True, seed=0)
    engine.add_request("a", "Tell me a long story about dragons.", params)
    for _ in range(5):
        engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort_request("a") is True
    assert engine.abort_request("a") is False
    assert engine.abort_request("never-existed") is False
    check_no_leak(engine.kv)


def test_stop_strings_and_stop_tokens(llm: LLM) -> None:
    base = llm.generate(
        "1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
    )
    text = base[0].outputs[0].text
    assert "8" in text, text
    cut = llm.generate(
        "1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=20, stop=["8"]), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "8"
    assert cut.text == text[: text.index("8")]
    kept = llm.generate(
        "1, 2, 3, 4, 5,",
        SamplingParams(temperature=0, max_tokens=20, stop=["8"], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index("8") + 1]
    first = base[0].outputs[0].token_ids[2]
    by_id = llm.generate(
        "1, 2, 3, 4, 5,",
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.token_ids == base[0].outputs[0].token_ids[:3]
    assert by_id.stop_reason == first and by_id.finish_reason == "stop"
    check_no_leak(llm.engine.kv)


def test_eos_ends_generation_and_chat_template(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "Say hello."}],
        SamplingParams(temperature=0, max_tokens=200),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.get_tokenizer().eos_token_ids
    assert out.text and "<|im_end|>" not in out.text


def test_n_branches_with_seeds_are_returned_in_order(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = llm.generate("Pick a random animal:", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        single = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6, ignore_eos=True)
        alone = llm.generate("Pick a random animal:", single, use_tqdm=False)[0].outputs[0]
        assert c.token_ids == alone.token_ids
    check_no_leak(llm.engine.kv)


def test_stats_report_capacity_and_usage(llm: LLM) -> None:
    prompt = " ".join(list(string.ascii_lowercase) * 2)
    together = llm.generate([prompt] * 2, GREEDY, use_tqdm=False)
    # Blocks join the cache only once computed, so the second waits one step for the first's
    # prefill and then hits its 3 full blocks (of 52 prompt tokens; the last is recomputed).
    assert [o.num_cached_tokens for o in together] == [0, 48]
    later = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert later.num_cached_tokens == 48
    s = llm.stats()
    assert s["kv_blocks_total"] == 256
    assert s["kv_blocks_free"] + s["kv_blocks_used"] + s["kv_blocks_evictable"] == 256
    assert s["prefix_cache_hit_tokens"] == 96
    assert "KV cache: 256 blocks x 16 tokens" in llm.engine.capacity_line


def test_unknown_and_corrupt_model_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        LLM(model=str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError):
        LLM(model=str(bad))


def test_cli_generate_prints_a_sensible_continuation() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagekv.cli",
            "generate",
            "The capital of France is",
            "--max-tokens",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "KV cache:" in proc.stderr and "max concurrency" in proc.stderr


def test_cli_sampling_options_reach_the_params() -> None:
    from pagekv import cli

    parser = argparse.ArgumentParser()
    cli._sampling_args(parser)
    args = parser.parse_args(
        ["--repetition-penalty", "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "-1"]
    )
    params = cli._params(args)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        1.3,
        0.5,
        -1.0,
    )
    assert cli._params(parser.parse_args([])) == SamplingParams(max_tokens=128, temperature=0.0)


def test_cli_chat_answers_and_ends_on_empty_line() -> None:
    # the exact path: int8 activations (the default) answer as llama.cpp does, "L'Étoile, ..."
    exact = ("--gguf-activations", "dtype")
    proc = subprocess.run(
        [sys.executable, "-m", "pagekv.cli", "chat", "--max-tokens", "24", *exact],
        input="What is the capital of France?\n\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_max_model_len_beyond_the_context_is_capped_with_a_warning(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    context = loaded.config.max_position_embeddings
    with caplog.at_level("WARNING", logger="pagekv"):
        engine = LLMEngine(EngineConfig(num_kv_blocks=16, max_model_len=context + 1), loaded)
    assert engine.max_model_len == context
    assert f"max_model_len {context + 1} is beyond the model's context" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagekv"):
        engine = LLMEngine(EngineConfig(num_kv_blocks=16, max_model_len=512), loaded)
    assert engine.max_model_len == 512 and "max_model_len" not in caplog.text


def test_params_set_after_construction_are_validated_as_new_ones() -> None:
    """vLLM's examples set fields on a made SamplingParams; a bad value changes nothing."""
    params = SamplingParams(max_tokens=None, top_k=0)  # 0: vLLM's "no limit", as -1
    assert params.top_k is None and params.until_context
    params.temperature = 0.5
    assert params.temperature == 0.5 and params.until_context  # still until the context ends
    params.max_tokens = 7
    assert params.max_tokens == 7 and not params.until_context
    params.stop = "END"  # normalized as the constructor does
    assert params.stop == ("END",)
    with pytest.raises(InvalidRequestError) as info:
        params.top_p = 1.5
    assert info.value.param == "top_p" and params.top_p == 1.0
    with pytest.raises(AttributeError):
        params.max_token = 5  # type: ignore[attr-defined]  # a typo is not a new field


def test_params_changed_after_generate_leave_the_request_alone(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    engine = llm.engine
    engine.add_request("mutated", "The capital of France is", params)
    params.max_tokens = 1
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs[0].outputs[0].token_ids) == 4


def test_a_stop_string_in_the_last_token_allowed_is_cut_and_named(llm: LLM) -> None:
    """The token that reaches max_tokens may hold a stop string: cut there, finish "stop"."""
    free = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    decode = llm.get_tokenizer().decode
    texts = [decode(free.token_ids[:k]) for k in range(len(free.token_ids) + 1)]
    k = next(k for k in range(2, len(texts)) if texts[k][len(texts[k - 1]) :] not in texts[k - 1])
    stop = texts[k][len(texts[k - 1]) :]  # token k's text, first seen there
    params = SamplingParams(temperature=0, max_tokens=k, stop=[stop])
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, texts[k - 1])
