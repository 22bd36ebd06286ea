"""vLLM's documented offline examples (vllm-project/vllm, examples/offline_inference: basic,
basic/chat, structured outputs, and the documented logprobs and beam search calls) run here with
only their import lines changed (``vllm`` -> ``pagekv``; vLLM's ``vllm.sampling_params``
``BeamSearchParams`` is ``pagekv.BeamSearchParams``), on the default model under its Hugging
Face id in a local HF cache. Each test makes the example's calls in the example's order, with
the command-line values a user could pass (small ``max_tokens``) where the example reads them,
and checks what the example prints is there."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from pagekv import LLM, BeamSearchParams, SamplingParams
from pagekv.sampling_params import StructuredOutputsParams
from tests.engine.test_vllm_offline_api import SMOL_ID, fake_hub_cache

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def llm(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """``LLM(model=...)`` as the examples build it (the structured outputs example's
    ``max_model_len=100``; a small KV pool to keep the test cheap)."""
    root = tmp_path_factory.mktemp("hub")
    fake_hub_cache(root, SMOL_ID, {os.path.basename(gguf_path): Path(gguf_path)})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_CACHE", str(root))
        llm = LLM(model=SMOL_ID, max_model_len=100, kv_cache_memory_bytes=32 * 2**20)
    yield llm
    llm.close()


def print_outputs(outputs: list[Any]) -> list[str]:
    texts = []
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
        texts.append(generated_text)
    return texts


def test_basic(llm: LLM) -> None:
    """examples/offline_inference/basic/basic.py"""
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(prompts, sampling_params)
    texts = print_outputs(outputs)
    assert [o.prompt for o in outputs] == prompts
    assert all(texts) and all(len(o.outputs[0].token_ids) <= 16 for o in outputs)


def test_chat(llm: LLM, tmp_path: Path) -> None:
    """examples/offline_inference/basic/chat.py, run with --max-tokens 6 --temperature 0 and
    --chat-template-path (the model's own template, written to a file)."""
    defaults = SamplingParams()
    sampling_params = SamplingParams(
        max_tokens=6, temperature=0.0, top_p=defaults.top_p, top_k=defaults.top_k
    )
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    (first,) = print_outputs(outputs)
    conversations = [conversation for _ in range(10)]
    outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
    assert print_outputs(outputs) == [first] * 10
    chat_template_path = tmp_path / "template.jinja"
    chat_template_path.write_text(llm.get_tokenizer().chat_template or "")
    with open(chat_template_path) as f:
        chat_template = f.read()
    outputs = llm.chat(conversations, sampling_params, use_tqdm=False, chat_template=chat_template)
    assert print_outputs(outputs) == [first] * 10


class CarType(str, Enum):  # noqa: UP042  # the example's own
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


SQL_GRAMMAR = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""


def test_structured_outputs(llm: LLM) -> None:
    """examples/offline_inference/structured_outputs.py: choice, regex, JSON schema (pydantic)
    and grammar, each with the example's parameters (default max_tokens: 16)."""
    choice = SamplingParams(
        structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"])
    )
    regex = SamplingParams(
        structured_outputs=StructuredOutputsParams(regex=r"\w+@\w+\.com\n"), stop=["\n"]
    )
    json_schema = CarDescription.model_json_schema()
    json = SamplingParams(structured_outputs=StructuredOutputsParams(json=json_schema))
    grammar = SamplingParams(structured_outputs=StructuredOutputsParams(grammar=SQL_GRAMMAR))
    cases = [
        ("Classify this sentiment: vLLM is wonderful!", choice),
        (
            "Generate an email address for Alan Turing, who works in Enigma."
            "End in .com and new line. Example result:"
            "alan.turing@enigma.com\n",
            regex,
        ),
        (
            "Generate a JSON with the brand, model and car_type of"
            "the most iconic car from the 90's",
            json,
        ),
        (
            "Generate an SQL query to show the 'username' and 'email'from the 'users' table.",
            grammar,
        ),
    ]
    texts = []
    for prompt, sampling_params in cases:
        outputs = llm.generate(prompts=prompt, sampling_params=sampling_params)
        texts.append(outputs[0].outputs[0].text)
        print(f"{'-' * 50}\n{texts[-1]}\n{'-' * 50}")
    assert texts[0] in ("Positive", "Negative")
    # the start of an address (16 tokens may end it early); the stop string "\n" is not kept
    assert re.fullmatch(r"\w+(@\w*(\.(c(om?)?)?)?)?", texts[1])
    assert texts[2].startswith("{")  # a JSON object, cut at 16 tokens
    assert texts[3].startswith("SELECT col_")


def test_logprobs(llm: LLM) -> None:
    """vLLM's documented logprobs call (and llm_engine_example.py's first prompt): the chosen
    token's and the top alternatives' ``Logprob`` objects per output token, and
    ``prompt_logprobs`` (None for the first prompt token)."""
    prompt = "A robot may not injure a human being"
    sampling_params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, prompt_logprobs=5)
    outputs = llm.generate(prompt, sampling_params)
    output = outputs[0]
    print(output.prompt_logprobs)
    for position in output.outputs[0].logprobs or []:
        for token_id, logprob in position.items():
            print(token_id, logprob.logprob, logprob.rank, logprob.decoded_token)
    completion = output.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in position and position[token_id].rank == 1  # greedy
        ranks = sorted(lp.rank for lp in position.values() if lp.rank is not None)
        assert ranks[:5] == [1, 2, 3, 4, 5]
        assert all(isinstance(lp.decoded_token, str) for lp in position.values())
    prompt_logprobs = output.prompt_logprobs
    assert prompt_logprobs is not None and prompt_logprobs[0] is None
    assert len(prompt_logprobs) == len(output.prompt_token_ids)
    for token_id, position in zip(output.prompt_token_ids[1:], prompt_logprobs[1:], strict=True):
        assert position is not None and token_id in position
        assert position[token_id].logprob <= 0.0


def test_beam_search(llm: LLM) -> None:
    """vLLM's documented beam search call: prompts as dicts, ``output.sequences[i].text``."""
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    outputs = llm.beam_search([{"prompt": "The capital of France is"}], params)
    for output in outputs:
        generated_text = output.sequences[0].text
        print(generated_text)
    (output,) = outputs
    prompt_ids = llm.get_tokenizer().encode("The capital of France is")
    assert 1 <= len(output.sequences) <= 3
    best = output.sequences[0]
    assert best.tokens[: len(prompt_ids)] == prompt_ids  # the prompt's tokens, then its own
    assert best.text == llm.get_tokenizer().decode(best.tokens, skip_special_tokens=True)
    assert best.text.startswith("The capital of France is")
    assert best.tokens[len(prompt_ids) :] == best.token_ids  # pagekv's name: generated only
    chosen = [p[t].logprob for t, p in zip(best.token_ids, best.logprobs, strict=True)]
    assert sum(chosen) == pytest.approx(best.cum_logprob, abs=1e-4)
