"""The offline API as a vLLM user calls it: ``LLM(...)``'s arguments, prompt forms, the
tokenizer ``get_tokenizer()`` hands out, chat options, the engine's seed, and Hugging Face ids
found in the local HF cache (never downloaded)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pagekv import InvalidRequestError, SamplingParams
from pagekv.core.invariants import check_manager
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig, host_pool_bytes
from pagekv.errors import ModelLoadError
from pagekv.inputs import TextPrompt, TokensPrompt
from pagekv.llm import LLM
from pagekv.models.hub import resolve_model_path
from pagekv.models.loader import LoadedModel

pytestmark = pytest.mark.model

SMOL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GREEDY = SamplingParams(temperature=0, max_tokens=4)
CHAT = [{"role": "user", "content": "Hi"}]
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if mood is defined %}(mood: {{ mood }})\n{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def fake_hub_cache(root: Path, repo_id: str, files: dict[str, Path | str]) -> Path:
    """A Hugging Face cache holding ``files`` (links to real files, or text) in ``repo_id``'s
    snapshot that refs/main points to, laid out as huggingface_hub writes it."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for name, source in files.items():
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path):
            target.symlink_to(source)
        else:
            target.write_text(source)
    return root


@pytest.fixture
def llm(loaded: LoadedModel) -> LLM:
    return LLM.from_engine(
        LLMEngine(EngineConfig(num_kv_blocks=128, check_invariants=True), loaded)
    )


@pytest.fixture
def smol_cache(gguf_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default model's GGUF under its Hugging Face id in a fresh HF cache."""
    root = fake_hub_cache(tmp_path / "hub", SMOL_ID, {os.path.basename(gguf_path): Path(gguf_path)})
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


# ---- LLM(...) with vLLM's arguments -----------------------------------------------------------


def test_a_hugging_face_id_and_vllms_arguments_build_an_llm(smol_cache: Path) -> None:
    llm = LLM(
        model=SMOL_ID,
        tokenizer=SMOL_ID,
        seed=0,
        enforce_eager=True,
        tensor_parallel_size=1,
        trust_remote_code=True,
        kv_cache_dtype="auto",
        dtype="auto",
        max_model_len="4k",
        swap_space=0.01,  # GiB
        gpu_memory_utilization=0.9,
        max_num_seqs=8,
        max_num_batched_tokens="1k",
        enable_prefix_caching=True,
        block_size=16,
        max_logprobs=5,
        disable_log_stats=True,
        quantization=None,
        kv_cache_memory_bytes="32MiB",
        revision=None,
        hf_token=None,
        chat_template=TEMPLATE,
    )
    config = llm.engine.config
    assert llm.engine.loaded.path.startswith(str(smol_cache))
    assert (llm.engine.max_model_len, config.max_num_batched_tokens, config.dtype) == (
        4000,
        1000,
        "float32",
    )
    assert host_pool_bytes(config) == int(0.01 * 2**30)
    out = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids
    assert _prompt_of_chat(llm, CHAT) == "[user] Hi\n[assistant]"  # LLM(chat_template=)
    llm.close()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"not_an_argument": 1}, "not_an_argument"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
        ({"data_parallel_size": 2}, "data_parallel_size"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype"),
        ({"dtype": "int4"}, "dtype"),
        ({"max_model_len": "4kk"}, "max_model_len"),
        ({"swap_space": "lots"}, "swap_space"),
        ({"revision": "v2"}, "revision"),
        ({"quantization": "awq"}, "quantization"),
        ({"cpu_offload_gb": 4}, "cpu_offload_gb"),
        ({"chat_template": "no/such/template.jinja"}, "chat_template"),
        ({"max_logprobs": -1}, "max_logprobs"),
    ],
)
def test_arguments_this_engine_cannot_honour_are_refused_by_name_before_loading(
    kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        LLM(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)


def test_a_model_id_not_in_the_cache_names_every_place_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError) as info:
        LLM("nobody/no-such-model")
    message = str(info.value)
    assert str(tmp_path / "hub" / "models--nobody--no-such-model") in message
    assert os.path.abspath("nobody/no-such-model") in message
    assert "HF_HUB_CACHE" in message and "downloaded" in message


def test_the_cache_is_found_as_huggingface_hub_finds_it(
    gguf_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    fake_hub_cache(tmp_path / "home" / "hub", SMOL_ID, {"m.gguf": Path(gguf_path)})
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model_path(SMOL_ID).endswith("m.gguf")
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    fake_hub_cache(tmp_path / "xdg" / "huggingface" / "hub", SMOL_ID, {"x.gguf": Path(gguf_path)})
    assert resolve_model_path(SMOL_ID).endswith("x.gguf")


def test_a_snapshot_with_safetensors_is_a_directory_and_several_ggufs_need_a_quant(
    gguf_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    fake_hub_cache(tmp_path, "org/dense", {"config.json": "{}", "model.safetensors": ""})
    assert resolve_model_path("org/dense").endswith(os.path.join("snapshots", "0123abcd"))
    ggufs = {"m-Q4_K_M.gguf": Path(gguf_path), "m-Q8_0.gguf": Path(gguf_path)}
    fake_hub_cache(tmp_path, "org/quants", ggufs)
    assert resolve_model_path("org/quants:Q8_0").endswith("m-Q8_0.gguf")
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        resolve_model_path("org/quants")
    with pytest.raises(ModelLoadError, match="no GGUF file matching 'Q2_K'"):
        resolve_model_path("org/quants:Q2_K")
    fake_hub_cache(tmp_path, "org/bin-only", {"config.json": "{}", "pytorch_model.bin": ""})
    with pytest.raises(ModelLoadError, match="no model weights"):
        resolve_model_path("org/bin-only")


# ---- the engine's seed ----------------------------------------------------------------------


def _sampled(loaded: LoadedModel, seed: int | None) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, seed=seed), loaded)
    params = SamplingParams(temperature=1.0, max_tokens=6)
    prompts = ["Once upon a time", "The weather today is", "My favourite food"]
    return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]


def test_the_engines_seed_makes_unseeded_requests_reproducible(loaded: LoadedModel) -> None:
    first = _sampled(loaded, seed=7)
    assert _sampled(loaded, seed=7) == first
    assert _sampled(loaded, seed=8) != first
    assert len({tuple(t) for t in first}) == 3  # each request its own seed


def test_a_requests_own_seed_is_kept(loaded: LoadedModel) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3)
    texts = []
    for engine_seed in (None, 1, 2):
        engine = LLMEngine(EngineConfig(num_kv_blocks=64, seed=engine_seed), loaded)
        texts.append(LLM.from_engine(engine).generate("Hello", params)[0].outputs[0].token_ids)
    assert texts[0] == texts[1] == texts[2]


def test_logprobs_above_max_logprobs_are_refused_and_leave_nothing(loaded: LoadedModel) -> None:
    engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_logprobs=2), loaded)
    llm = LLM.from_engine(engine)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    assert info.value.param == "logprobs" and "max_logprobs" in str(info.value)
    assert not engine.has_unfinished_requests()
    check_manager(engine.kv)
    ok = llm.generate("Hello", SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)[0]
    assert ok.outputs[0].logprobs is not None


# ---- prompt forms -----------------------------------------------------------------------------


def test_vllms_prompt_forms(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    by_text = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    bare = llm.generate(ids, GREEDY, use_tqdm=False)  # one tokenized prompt
    assert len(bare) == 1 and bare[0].prompt_token_ids == ids
    assert bare[0].outputs[0].token_ids == by_text.outputs[0].token_ids
    several = llm.generate([ids, ids[:3]], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in several] == [ids, ids[:3]]
    forms: list[Any] = [
        TokensPrompt(prompt_token_ids=ids),
        TokensPrompt(prompt_token_ids=ids, prompt="(given)"),
        TextPrompt(prompt="The capital of France is"),
        TextPrompt(prompt="The capital of France is", cache_salt="tenant-a"),
        "The capital of France is",
        ids,
    ]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert {tuple(o.outputs[0].token_ids) for o in outs} == {tuple(by_text.outputs[0].token_ids)}
    assert [o.prompt for o in outs[:3]] == [None, "(given)", "The capital of France is"]
    assert llm.generate([], GREEDY, use_tqdm=False) == []


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        ({"prompt": "x", "multi_modal_data": {"image": object()}}, "multi_modal_data"),
        ({"prompt_token_ids": [1, 2], "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
        ({"prompt_embeds": [[0.0]]}, "prompt_embeds"),
        ({"prompt": "x", "temperature": 0}, "temperature"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
        ({}, "prompt"),
        ([[1, 2], "text", 3], "prompt"),
        (b"bytes", "prompt"),
    ],
)
def test_prompt_forms_this_engine_does_not_take_are_refused_by_name(
    llm: LLM, prompt: object, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(prompt, GREEDY, use_tqdm=False)  # type: ignore[arg-type]
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_generate_takes_priority_and_refuses_lora(llm: LLM) -> None:
    outs = llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0, 1])
    assert len(outs) == 2
    with pytest.raises(InvalidRequestError, match="priority"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("a", GREEDY, use_tqdm=False, lora_request=object())
    assert info.value.param == "lora_request"


# ---- the tokenizer get_tokenizer() hands out ----------------------------------------------


def test_get_tokenizer_is_used_like_a_transformers_tokenizer(llm: LLM, hf_tokenizer: Any) -> None:
    tok = llm.get_tokenizer()
    text = "Hello, world! Paris is the capital of France."
    assert tok(text).input_ids == tok(text)["input_ids"] == hf_tokenizer(text).input_ids
    assert tok([text, "hi"]).input_ids == hf_tokenizer([text, "hi"]).input_ids
    assert tok.encode(text) == hf_tokenizer.encode(text)
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tokenizer.decode(ids)
    assert tok.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(ids[0]) == hf_tokenizer.convert_ids_to_tokens(ids[0])
    assert tok.convert_tokens_to_ids("Hello") == hf_tokenizer.convert_tokens_to_ids("Hello")
    assert tok.eos_token_id == hf_tokenizer.eos_token_id
    assert tok.eos_token == hf_tokenizer.eos_token
    assert tok.vocab_size == hf_tokenizer.vocab_size
    assert len(tok) == len(hf_tokenizer)
    special = [tok.eos_token_id, *ids]
    assert tok.decode(special) == hf_tokenizer.decode(special)  # special tokens kept
    assert tok.decode(special, skip_special_tokens=True) == hf_tokenizer.decode(
        special, skip_special_tokens=True
    )
    with pytest.raises(InvalidRequestError) as info:
        tok(text, return_tensors="pt")
    assert info.value.param == "return_tensors"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_apply_chat_template_as_transformers(
    llm: LLM, hf_tokenizer: Any, add_generation_prompt: bool
) -> None:
    tok = llm.get_tokenizer()
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    kwargs = {"add_generation_prompt": add_generation_prompt}
    text = tok.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert text == hf_tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    encoded = tok.apply_chat_template(conversation, **kwargs)
    expected = hf_tokenizer.apply_chat_template(conversation, **kwargs)
    assert encoded.input_ids == encoded["input_ids"] == list(expected["input_ids"])
    ids = tok.apply_chat_template(conversation, return_dict=False, **kwargs)
    assert ids == hf_tokenizer.apply_chat_template(conversation, return_dict=False, **kwargs)
    assert tok.apply_chat_template([conversation, conversation], tokenize=False, **kwargs) == [
        text,
        text,
    ]


def test_continue_final_message_as_transformers(llm: LLM, hf_tokenizer: Any) -> None:
    tok = llm.get_tokenizer()
    conversation = [*CHAT, {"role": "assistant", "content": "Hello! I am"}]
    kwargs = {"tokenize": False, "continue_final_message": True}
    text = tok.apply_chat_template(conversation, **kwargs)
    assert text == hf_tokenizer.apply_chat_template(conversation, **kwargs)
    assert text.endswith("Hello! I am")


# ---- LLM.chat with vLLM's options -----------------------------------------------------------


def _prompt_of_chat(llm: LLM, messages: Any, **options: Any) -> str:
    out = llm.chat(messages, GREEDY, use_tqdm=False, **options)[0]
    assert out.outputs[0].token_ids
    return str(out.prompt)


def test_chat_options(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    plain = _prompt_of_chat(llm, CHAT)
    assert plain == tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    bare = _prompt_of_chat(llm, CHAT, add_generation_prompt=False)
    assert plain.startswith(bare) and plain != bare
    going_on = [*CHAT, {"role": "assistant", "content": "Well, I think"}]
    continued = _prompt_of_chat(
        llm, going_on, add_generation_prompt=False, continue_final_message=True
    )
    assert continued.endswith("Well, I think")
    with pytest.raises(InvalidRequestError) as info:
        llm.chat(going_on, GREEDY, use_tqdm=False, continue_final_message=True)
    assert info.value.param == "continue_final_message"
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert _prompt_of_chat(llm, parts) == plain  # OpenAI's content parts, text only
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidRequestError, match="text parts only"):
        llm.chat(image, GREEDY, use_tqdm=False)


def test_chat_templates_given_by_text_or_path_and_their_kwargs(llm: LLM, tmp_path: Path) -> None:
    assert _prompt_of_chat(llm, CHAT, chat_template=TEMPLATE) == "[user] Hi\n[assistant]"
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    moody = _prompt_of_chat(
        llm, CHAT, chat_template=str(path), chat_template_kwargs={"mood": "calm", "unused": 1}
    )
    assert moody == "[user] Hi\n(mood: calm)\n[assistant]"  # unread kwargs dropped, as vLLM
    with pytest.raises(InvalidRequestError) as info:
        llm.chat(CHAT, GREEDY, chat_template_kwargs={"tokenize": True})
    assert info.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError) as info:
        llm.chat(CHAT, GREEDY, chat_template="missing.jinja")
    assert info.value.param == "chat_template"


# ---- issue #58's offline list, item by item -----------------------------------------------


def test_the_issues_offline_list_each_item_retried(llm: LLM, smol_cache: Path) -> None:
    """Every observation of issue #58's "Offline API" item, tried again: each passes (or, for
    values this engine cannot honour, is refused naming the field: see the tests above)."""
    import pagekv
    from pagekv.engine import llm_args

    # LLM(seed=0), enforce_eager, tensor_parallel_size=1, trust_remote_code, kv_cache_dtype
    # "auto", dtype "auto"/"half", swap_space=4 (GiB), max_model_len="4k": accepted as vLLM's
    for dtype, engine_dtype in (("auto", "float32"), ("half", "bfloat16")):
        config = llm_args.engine_config(
            None,
            {
                "seed": 0,
                "enforce_eager": True,
                "tensor_parallel_size": 1,
                "trust_remote_code": True,
                "kv_cache_dtype": "auto",
                "dtype": dtype,
                "swap_space": 4,
                "max_model_len": "4k",
            },
        )
        assert (config.seed, config.dtype, config.max_model_len) == (0, engine_dtype, 4000)
        assert host_pool_bytes(config) == 4 * 2**30
    # SamplingParams(top_k=-1), stop=None, max_tokens=None
    unbounded = SamplingParams(temperature=0, top_k=-1, stop=None, max_tokens=None)
    assert unbounded.top_k is None and unbounded.stop == ()
    # prompt_logprobs, logit_bias, allowed_token_ids, bad_words; Logprob objects; a bare
    # list[int] prompt
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    params = SamplingParams(
        temperature=0,
        max_tokens=3,
        logprobs=2,
        prompt_logprobs=2,
        logit_bias={ids[0]: -5.0},
        allowed_token_ids=list(range(1000, 20000)),
        bad_words=["Paris"],
    )
    out = llm.generate(ids, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert all(1000 <= t < 20000 for t in completion.token_ids)
    assert "Paris" not in completion.text
    first = completion.logprobs[0][completion.token_ids[0]]  # type: ignore[index]
    assert isinstance(first, pagekv.Logprob)
    # ranked under the raw distribution (vLLM's default), before the bias and the allowed set
    assert isinstance(first.rank, int) and first.rank >= 1
    assert (type(first.logprob), type(first.decoded_token)) == (float, str)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert out.metrics is not None and out.metrics.num_generation_tokens == 3
    # beam outputs named as vLLM's
    beams = llm.beam_search([TokensPrompt(prompt_token_ids=ids)], pagekv.BeamSearchParams(2, 3))
    best = beams[0].sequences[0]
    assert (len(best.tokens), len(best.logprobs)) == (len(ids) + 3, 3)
    assert isinstance(best.cum_logprob, float) and best.text.startswith(tok.decode(ids))
    # get_tokenizer() callable, with transformers' apply_chat_template
    assert tok("Hi").input_ids == tok.encode("Hi")
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and text.endswith("assistant\n")
    # TokensPrompt / TextPrompt exported (from pagekv and pagekv.inputs)
    assert pagekv.TokensPrompt is TokensPrompt and pagekv.TextPrompt is TextPrompt
    # a Hugging Face model id in the local HF cache
    assert resolve_model_path(SMOL_ID).startswith(str(smol_cache))
