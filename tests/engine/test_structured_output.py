"""Structured output in the engine (llguidance): every output matches its JSON schema, regular
expression, choice or grammar; the mask changes nothing for the rows that do not ask; drafted
decodes check their drafts against the grammar; a constraint that does not compile is refused
with nothing allocated."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from pagekv import SamplingParams, StructuredOutputsParams
from pagekv.core.invariants import check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.errors import InvalidRequestError
from pagekv.llm import LLM
from pagekv.models.loader import LoadedModel
from pagekv.runner.sampler import Sampler, SamplingRow, apply_token_masks

# Bounded (maxLength, maxItems, enums) so that every output completes well inside max_tokens.
SCHEMAS: list[dict[str, object]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            }
        },
        "required": ["address"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
]
REGEX = r"[A-Z][a-z]{2,6} [0-9]{2}"
CHOICES = ("yes", "no", "maybe")
LARK = 'start: "The answer is " ANSWER "."\nANSWER: /[0-9]{1,3}/'
GBNF = 'root ::= ("yes" | "no") ", " [a-z] [a-z]? [a-z]?'  # llama.cpp's grammar format
QUESTIONS = [
    "Describe a person as JSON.",
    "Give me some data.",
    "What is the weather like in Paris?",
    "List a few things.",
]

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def llm(loaded: LoadedModel) -> LLM:
    config = EngineConfig(num_kv_blocks=256, check_invariants=True)
    return LLM.from_engine(LLMEngine(config, loaded))


def chat(llm: LLM, question: str) -> str:
    return llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def constrained(max_tokens: int = 96, **constraint: object) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint),  # type: ignore[arg-type]
    )


def texts(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[tuple[str, str]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].text, str(o.outputs[0].finish_reason)) for o in outs]


def test_token_masks_leave_exactly_the_allowed_tokens() -> None:
    vocab = 100
    logits = torch.randn(3, vocab)
    allowed = [np.array([3, 31, 32, 64, 99]), None, np.array([0, 50])]
    rows = []
    for ids in allowed:
        mask = None
        if ids is not None:
            bits = np.zeros(4 * 32, dtype=np.uint8)
            bits[ids] = 1
            mask = np.packbits(bits, bitorder="little").view(np.int32)
        rows.append(SamplingRow(SamplingParams(temperature=0), allowed_tokens=mask))
    masked = apply_token_masks(logits, rows)
    for i, ids in enumerate(allowed):
        if ids is None:
            assert torch.equal(masked[i], logits[i])
            continue
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[torch.from_numpy(ids)] = True
        assert torch.equal(masked[i][keep], logits[i][keep])
        assert bool(torch.isneginf(masked[i][~keep]).all())
    chosen = Sampler()(logits, rows).token_ids
    assert chosen[1] == int(logits[1].argmax())
    assert chosen[0] == int(allowed[0][logits[0][allowed[0]].argmax()])  # type: ignore[index]


def test_every_output_matches_its_constraint(llm: LLM) -> None:
    prompts, params, checks = [], [], []
    for i, schema in enumerate(SCHEMAS):
        for question in QUESTIONS[:2]:
            prompts.append(chat(llm, question))
            params.append(constrained(json=schema))
            checks.append(("json", schema))
        sampled = SamplingParams(
            temperature=0.9,
            seed=i,
            max_tokens=96,
            n=2,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        prompts.append(chat(llm, QUESTIONS[2]))
        params.append(sampled)
        checks.append(("json", schema))
    for question in QUESTIONS:
        prompts += [chat(llm, question)] * 4
        params += [
            constrained(regex=REGEX),
            constrained(choice=list(CHOICES)),
            constrained(grammar=LARK),
            constrained(grammar=GBNF),
        ]
        checks += [("regex", REGEX), ("choice", CHOICES)]
        checks += [("regex", r"The answer is [0-9]{1,3}\."), ("regex", r"(yes|no), [a-z]{1,3}")]
    prompts.append(chat(llm, "Describe a person as a JSON object with a name and an age."))
    params.append(constrained(json_object=True, max_tokens=200))
    checks.append(("object", None))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, (kind, rule) in zip(outs, checks, strict=True):
        for choice in out.outputs:
            assert choice.finish_reason == "stop", (kind, choice.text)
            if kind == "json":
                jsonschema.validate(json.loads(choice.text), rule)
            elif kind == "regex":
                assert re.fullmatch(str(rule), choice.text), choice.text
            elif kind == "choice":
                assert choice.text in CHOICES
            else:
                assert isinstance(json.loads(choice.text), dict)
    assert llm.stats()["kv_blocks_used"] == 0
    assert len(llm.engine.structured) == 0
    check_no_leak(llm.engine.kv)


def test_rows_without_a_constraint_are_unchanged(llm: LLM) -> None:
    free = [chat(llm, q) for q in QUESTIONS]
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = texts(llm, free, [plain] * len(free))
    bound = [constrained(json=SCHEMAS[i % len(SCHEMAS)]) for i in range(len(free))]
    mixed = texts(llm, free + free, [plain] * len(free) + bound)
    assert mixed[: len(free)] == alone
    assert all(text != alone[i][0] for i, (text, _) in enumerate(mixed[len(free) :]))


def test_the_grammar_ending_ends_the_request(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0,
        max_tokens=40,
        ignore_eos=True,  # only the grammar can end it before max_tokens
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]),
    )
    (out,) = llm.generate([chat(llm, "Pick one.")], params, use_tqdm=False)
    assert out.outputs[0].text in ("alpha", "beta")
    assert out.outputs[0].finish_reason == "stop"
    assert len(out.outputs[0].token_ids) < 40


def test_drafted_decodes_check_their_drafts_against_the_grammar(loaded: LoadedModel) -> None:
    """Prompts that n-gram drafting predicts well, under constraints the drafts partly break:
    the same tokens with drafts as without, all matching."""
    prompts = [
        "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat.",
        "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,",
    ]
    params = [
        constrained(regex=r"( the cat sat on the (mat|hat)\.){1,4}", max_tokens=60),
        constrained(regex=r"( [1-3],){2,12}", max_tokens=60),
    ]
    runs = []
    for k in (0, 4):
        config = EngineConfig(num_kv_blocks=256, check_invariants=True, num_speculative_tokens=k)
        llm = LLM.from_engine(LLMEngine(config, loaded))
        runs.append(texts(llm, prompts, params))
        if k:
            stats = llm.stats()
            assert stats["accepted_draft_tokens"] > 10  # the drafted path did the work
        check_no_leak(llm.engine.kv)
    assert runs[0] == runs[1]
    for (text, reason), param in zip(runs[1], params, strict=True):
        assert param.structured_outputs is not None
        assert re.fullmatch(str(param.structured_outputs.regex), text), (text, reason)


@pytest.mark.parametrize(
    ("constraint", "param"),
    [
        ({"json": {"type": "no-such-type"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "structured_outputs.json"),
        ({"json": {"$ref": "#"}}, "structured_outputs.json"),  # itself: no output at all
        ({"regex": "(("}, "structured_outputs.regex"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_with_nothing_allocated(
    llm: LLM, constraint: dict[str, object], param: str
) -> None:
    params = constrained(**constraint)
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.add_request("bad", "Hello", params)
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.engine.structured) == 0
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    "values",
    [{}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"json": 5}, {"regex": ""}],
)
def test_a_malformed_constraint_is_a_typed_error(values: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputsParams(**values)  # type: ignore[arg-type]
    assert str(info.value.param).startswith("structured_outputs")
