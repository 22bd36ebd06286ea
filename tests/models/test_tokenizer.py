"""Tokenizer and chat template: golden against transformers on the real SmolLM2 GGUF, plus unit
tests of message validation, the template environment and the GGUF tokenizer builder."""

from __future__ import annotations

from typing import Any

import pytest

from pagekv.errors import InvalidRequestError, ModelLoadError
from pagekv.models import LoadedModel
from pagekv.models.chat_template import ChatTemplate
from pagekv.models.gguf_tokenizer import backend_from_gguf, byte_alphabet
from pagekv.models.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The capital of France is",
    "1234567890 and 3.14159, 2024-01-01",
    "x = [i**2 for i in range(10)]  # squares",
    "def f(a, b):\n    return a + b\n",
    "multiple   spaces\tand\ttabs",
    "\n\n\nnewlines\n\n",
    "  leading and trailing  ",
    "naïve café, résumé, Ünïcödé",
    "日本語のテキスト、中文文本",
    "Привет, мир! Γειά σου Κόσμε",
    "emoji 😀🎉👍🏽 and 🇫🇷 flags",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end",
    "don't won't it's we'll they've I'm",
    "URL: https://example.com/a?b=c&d=e#frag",
    "",
    " ",
    "MiXeD CaSe WoRdS and ALLCAPS",
    "tab\tseparated\tvalues\r\nwindows line",
]

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    [{"role": "user", "content": "Tell me a joke about cats."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a color."},
    ],
]


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(loaded: LoadedModel, hf_tokenizer: Any, text: str) -> None:
    expected = hf_tokenizer.encode(text, add_special_tokens=True)
    assert loaded.tokenizer.encode(text) == expected


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(loaded: LoadedModel, hf_tokenizer: Any, text: str) -> None:
    tok = loaded.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.model
def test_special_tokens(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    assert tok.vocab_size == loaded.config.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("hi")[0] != tok.bos_token_id  # SmolLM2's metadata: add_bos_token False
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.decode([1, *tok.encode("hi"), 2]) == "hi"
    with pytest.raises(InvalidRequestError):
        tok.id_to_token(tok.vocab_size)


@pytest.mark.model
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    loaded: LoadedModel,
    hf_tokenizer: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert loaded.tokenizer.apply_chat_template(messages, add_generation_prompt) == expected


BAD_MESSAGES: list[tuple[object, str]] = [
    ([], "non-empty list"),
    (None, "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\]\.role"),
    ([{"role": "robot", "content": "hi"}], r"messages\[0\]\.role"),
    ([{"role": 3, "content": "hi"}], r"messages\[0\]\.role"),
    ([{"role": "user"}], r"messages\[0\]\.content"),
    (
        [{"role": "user", "content": "ok"}, {"role": "user", "content": 5}],
        r"messages\[1\]\.content",
    ),
]


@pytest.mark.model
@pytest.mark.parametrize(("messages", "problem"), BAD_MESSAGES)
def test_bad_messages_raise(loaded: LoadedModel, messages: Any, problem: str) -> None:
    with pytest.raises(InvalidRequestError, match=problem):
        loaded.tokenizer.apply_chat_template(messages)


def test_template_raise_exception_becomes_invalid_request() -> None:
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}ok",
        {},
    )
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first must be user"):
        template.render([{"role": "system", "content": "x"}])


def test_template_environment_is_transformers_like() -> None:
    source = (
        "{% for m in messages %}\n"
        "  {% generation %}{{ m['content'] | tojson }}{% endgeneration %}\n"
        "{% if loop.last %}{% break %}{% endif %}\n"
        "{% endfor %}{{ bos_token }}"
    )
    template = ChatTemplate(source, {"bos_token": "<s>"})
    # trim_blocks + lstrip_blocks eat the indentation and newlines around block tags; tojson
    # leaves non-ASCII and "<" unescaped. Expected text is what transformers renders.
    assert template.render([{"role": "user", "content": "é<b>"}]) == '"é<b>"<s>'


def test_template_that_does_not_compile_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="does not compile"):
        ChatTemplate("{% for %}", {})


def test_template_sandbox_blocks_attribute_escape() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(InvalidRequestError):
        template.render([{"role": "user", "content": "x"}])


def _tiny_gguf_metadata(**extra: object) -> dict[str, object]:
    """A byte-level vocabulary of the 256 byte characters, one merge, and control tokens."""
    tokens = [*byte_alphabet().values(), "ab", "<s>", "</s>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.token_type": [1] * 257 + [3, 3],
        "tokenizer.ggml.bos_token_id": 257,
        "tokenizer.ggml.eos_token_id": 258,
        **extra,
    }


def test_gguf_tokenizer_adds_bos_only_when_metadata_says_so() -> None:
    plain = Tokenizer(backend_from_gguf(_tiny_gguf_metadata(), "tiny"), 257, (258,), None)
    assert plain.encode("ab1") == [256, ord("1") - ord("!")]
    with_bos = backend_from_gguf(_tiny_gguf_metadata(**{"tokenizer.ggml.add_bos_token": True}), "t")
    assert Tokenizer(with_bos, 257, (258,), None).encode("ab") == [257, 256]
    assert plain.encode("<s>ab</s>") == [257, 256, 258]
    with pytest.raises(InvalidRequestError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"tokenizer.ggml.model": "bert"}, "not supported"),
        ({"tokenizer.ggml.pre": "mystery"}, "pre-tokenizer 'mystery'"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
    ],
)
def test_gguf_tokenizer_rejects_unknown_layouts(extra: dict[str, object], problem: str) -> None:
    with pytest.raises(ModelLoadError, match=problem):
        backend_from_gguf(_tiny_gguf_metadata(**extra), "tiny.gguf")
