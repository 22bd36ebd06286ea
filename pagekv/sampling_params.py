"""How one request is sampled and when it stops: ``SamplingParams`` (pure Python, no torch).

Named and defaulted as vLLM users expect, with vLLM's accepted ranges. Validation happens in
``__post_init__`` so an invalid object never exists: every error, a wrong type included, is an
``InvalidRequestError`` naming the parameter, raised before the engine allocates anything. Every
number must be finite (no NaN, no infinity); token ids (``stop_token_ids``, ``logit_bias``'s keys,
``allowed_token_ids``) are checked against the vocabulary by the engine, which knows its size, and
``bad_words`` are tokenized there.

The sampler works in float32, where some accepted values do not exist: ``top_p`` 1e-300 rounds
to 0 and ``repetition_penalty`` 1e-300 to 0 (a division by zero). Those two are clamped here to
the nearest value that float32 holds and that means the same thing (see ``MIN_TOP_P`` and
``REPETITION_PENALTY_RANGE``); the sampler guards the rest (``runner/sampler.py``).
"""

from __future__ import annotations

import copy
import json
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from itertools import islice
from typing import Any

from pagekv.errors import InvalidRequestError

MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed takes
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as in OpenAI's API
# Caps vLLM does not have, so that one call cannot take the machine's memory (n=10**6 did):
# the server caps n lower (ServerConfig.max_n); OpenAI allows 4 stop strings, we allow more.
MAX_N = 1024  # n and best_of: sequences one request generates
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1000
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 2**16  # entries of logit_bias
MAX_ALLOWED_TOKEN_IDS = 2**18  # the largest vocabularies in use (Gemma's 262k)
MAX_BAD_WORDS = 64  # each is up to two token sequences: vLLM's cap of 128 sequences
MAX_BAD_WORD_CHARS = 1000
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's documented range; a value outside is clamped
# float32's smallest normal number. Any top_p up to the top token's probability (>= 1 / vocab)
# keeps that token alone, so a smaller one is raised to this, which float32 holds.
MIN_TOP_P = 2.0**-126
# A repetition penalty of 1e-30 already makes a seen token's positive logit 1e30 times larger
# (it wins outright, and the logits' order survives); one of 1e30 already takes such a logit to
# ~0 and a negative one past any other. Beyond these, float32 would overflow to inf or round to
# 0 (a division by zero), so a penalty outside the range is clamped into it.
REPETITION_PENALTY_RANGE = (1e-30, 1e30)
# What ``max_tokens`` holds between ``SamplingParams(max_tokens=None)`` and the engine, which
# replaces it with the room the prompt leaves in the context (``fit_to_context``).
UNTIL_CONTEXT_MAX_TOKENS = 2**31 - 1


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param}: {message}", param=param)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_text(value: object) -> bool:
    """A string that is valid Unicode (no lone surrogate such as "\\ud800", which no tokenizer
    or UTF-8 encoder takes)."""
    return isinstance(value, str) and value.encode("utf-8", "surrogatepass") == value.encode(
        "utf-8", "replace"
    )


def check_text(value: str, param: str) -> None:
    """Raise InvalidRequestError naming ``param`` if ``value`` is not valid Unicode text."""
    _check(_is_text(value), param, "must be valid Unicode text (it has a lone surrogate)")


def _bounded_tuple(value: object, param: str, limit: int) -> tuple[Any, ...]:
    """The items of a list-like ``value`` (None: none), at most ``limit`` of them. A string,
    bytes or a mapping is not a list here; a generator is read no further than the limit."""
    if value is None:
        return ()
    if isinstance(value, str | bytes | bytearray | Mapping) or not isinstance(value, Iterable):
        raise InvalidRequestError(f"{param}: must be a list, got {type(value).__name__}", param)
    items = tuple(islice(value, limit + 1))
    _check(len(items) <= limit, param, f"at most {limit} items")
    return items


def _is_token_id(value: object) -> bool:
    """A non-negative integer, numpy's included (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _is_finite(value: object) -> bool:
    """A number that is no NaN or infinity, nor an integer past the range of a float."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _logit_bias(value: object) -> dict[int, float]:
    """A fresh ``{token id: bias}``, each bias clamped to ``LOGIT_BIAS_RANGE``. Keys may be
    integers or their decimal text (JSON objects have text keys, as OpenAI's API sends them)."""
    param = "logit_bias"
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{param}: must be a mapping, got {type(value).__name__}", param)
    _check(len(value) <= MAX_LOGIT_BIAS, param, f"at most {MAX_LOGIT_BIAS} entries")
    low, high = LOGIT_BIAS_RANGE
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_key(key)
        _check(token is not None, param, f"keys must be token ids, got {key!r:.80}")
        _check(_is_finite(bias), param, f"values must be finite numbers, got {bias!r:.80}")
        out[int(token)] = min(max(float(bias), low), high)  # type: ignore[arg-type]
    return out


def _token_key(key: object) -> int | None:
    """A token id given as an integer or as its decimal text; None if it is neither."""
    if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():
        return int(key)
    return int(key) if _is_token_id(key) else None  # type: ignore[call-overload]


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the text a request may generate (vLLM's name and fields); exactly one
    is set. ``json``: a JSON schema (a dict or its JSON text); ``json_object``: any JSON
    object; ``regex``: a regular expression the whole output matches; ``choice``: one of these
    strings; ``grammar``: a Lark or GBNF grammar. Whether a schema, expression or grammar can
    be compiled is checked by the engine (``engine/structured_output.py``), which owns the
    compiler; here only the shape.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        param = "structured_outputs"
        given = [name for name, value in self.items() if value not in (None, False)]
        _check(len(given) == 1, param, f"exactly one constraint must be set, got {given}")
        (kind,) = given
        value = getattr(self, kind)
        if kind == "json":
            _check(isinstance(value, str | dict), f"{param}.json", "must be a schema object")
        elif kind == "json_object":
            _check(value is True, f"{param}.json_object", "must be true or unset")
        elif kind == "choice":
            _check(
                isinstance(value, tuple) and bool(value) and all(isinstance(c, str) for c in value),
                f"{param}.choice",
                "must be a non-empty list of strings",
            )
        else:
            _check(isinstance(value, str) and bool(value), f"{param}.{kind}", "must be text")

    def items(self) -> list[tuple[str, object]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    @property
    def kind(self) -> str:
        """Which constraint is set: json, json_object, regex, choice or grammar."""
        return next(name for name, value in self.items() if value not in (None, False))

    def key(self) -> tuple[str, str]:
        """The constraint as hashable text (a compiled-grammar cache key)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict | tuple):
            return self.kind, json.dumps(value, sort_keys=True)
        return self.kind, str(value)


@dataclass
class SamplingParams:
    """Sampling and stopping settings of one request.

    ``temperature == 0`` is greedy. ``top_k=None`` (or -1, as in vLLM) and ``top_p=1`` disable
    those filters; a ``top_p`` below ``MIN_TOP_P`` is raised to it (both keep the top token
    alone). ``max_tokens=None``: generate until the context ends (the engine sets the number
    from the prompt's length and the context, or the whole KV pool if that holds less;
    ``until_context`` says so until then). ``stop=None`` and ``stop_token_ids=None``: none.
    ``n``, ``best_of``, ``stop`` and ``stop_token_ids`` have caps (``MAX_*`` above).
    With ``seed`` set, branch ``i`` of an ``n > 1`` request samples with ``seed + i``.
    ``logprobs=k`` returns the chosen token's log-probability and the top ``k`` alternatives,
    all under the model's raw distribution (before penalties, temperature and filters), as vLLM
    does. Penalties, as OpenAI and vLLM define them, change the logits of tokens already seen
    before anything else: ``repetition_penalty`` divides a positive logit (multiplies a
    negative one) of every token in the prompt or the output so far; then each token's logit
    loses ``frequency_penalty`` times its count in the output, and ``presence_penalty`` once if
    it occurs there at all. ``structured_outputs`` constrains the text to a JSON schema, a
    regular expression, a choice or a grammar: tokens that would leave it are never drawn.

    Token-level controls, applied to the raw logits before the penalties and the filters, and
    to greedy rows too: ``logit_bias`` adds its value (clamped to [-100, 100], OpenAI's range)
    to each listed token's logit; ``allowed_token_ids`` leaves only those tokens drawable;
    ``bad_words`` (vLLM's meaning) are never completed: the engine tokenizes each word with
    and without a leading space, and a word's last token is barred wherever the output so far
    ends with the rest of it (a one-token word is barred outright). Like vLLM's default
    (``logprobs_mode="raw_logprobs"``), ``logprobs`` report the distribution before these,
    as before the penalties.
    ``prompt_logprobs=k`` returns, for every prompt token after the first, its log-probability
    given the tokens before it and the top ``k`` alternatives (``RequestOutput.prompt_logprobs``);
    such a request does not read the prefix cache, whose hits would skip those positions.
    ``max_tokens=0`` is allowed only with ``prompt_logprobs``: the prompt is prefilled and
    scored, nothing is generated (finish reason "length").
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    # True when max_tokens=None was given; dataclasses.replace resets it unless it passes
    # max_tokens=None again.
    until_context: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        # Accept a single stop string or list, as the OpenAI API does; store tuples (frozen).
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        set_field = object.__setattr__
        set_field(self, "stop", _bounded_tuple(stop, "stop", MAX_STOP_STRINGS))
        ids = _bounded_tuple(self.stop_token_ids, "stop_token_ids", MAX_STOP_TOKEN_IDS)
        set_field(self, "stop_token_ids", ids)
        bad_words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        set_field(self, "bad_words", _bounded_tuple(bad_words, "bad_words", MAX_BAD_WORDS))
        if self.allowed_token_ids is not None:
            allowed = _bounded_tuple(
                self.allowed_token_ids, "allowed_token_ids", MAX_ALLOWED_TOKEN_IDS
            )
            set_field(self, "allowed_token_ids", allowed)
        if self.logit_bias is not None:
            set_field(self, "logit_bias", _logit_bias(self.logit_bias))
        set_field(self, "until_context", self.max_tokens is None)
        if self.max_tokens is None:
            set_field(self, "max_tokens", UNTIL_CONTEXT_MAX_TOKENS)
        if _is_int(self.top_k) and self.top_k in (-1, 0):  # vLLM's "disabled" (0 since 0.10)
            set_field(self, "top_k", None)
        self._validate()
        # float32 stand-ins for values it cannot hold (the module docstring says why)
        set_field(self, "top_p", max(self.top_p, MIN_TOP_P))
        low, high = REPETITION_PENALTY_RANGE
        set_field(self, "repetition_penalty", min(max(self.repetition_penalty, low), high))
        set_field(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.allowed_token_ids is not None:
            set_field(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        set_field(self, "bad_words", tuple(dict.fromkeys(self.bad_words)))  # unique, in order
        set_field(self, "_validated", True)

    def __setattr__(self, name: str, value: object) -> None:
        """Set after construction (vLLM's ``params.max_tokens = 100``): validated as a new
        object; a bad value raises and changes nothing."""
        if not self.__dict__.get("_validated", False):  # __init__ filling the fields
            return object.__setattr__(self, name, value)
        if name not in {f.name for f in fields(self) if f.init}:
            raise AttributeError(f"SamplingParams has no field {name!r}")
        keep: dict[str, Any] = {"max_tokens": None} if self.until_context else {}  # as given
        self.__dict__.update(replace(self, **{**keep, name: value}).__dict__)

    def clone(self) -> SamplingParams:
        """A copy that assignments to these params leave alone (vLLM's name)."""
        copied = copy.copy(self)
        copied.__dict__["logit_bias"] = self.logit_bias and dict(self.logit_bias)
        return copied

    def fit_to_context(self, room_tokens: int) -> SamplingParams:
        """These params for a prompt that leaves ``room_tokens`` of context: with
        ``max_tokens=None`` given, max_tokens becomes that (at least 1); else unchanged."""
        if not self.until_context:
            return self
        return replace(self, max_tokens=max(1, room_tokens))

    def _validate(self) -> None:
        """Each field group in turn; the first bad value raises."""
        self._validate_branches()
        self._validate_sampling()
        self._validate_stopping()
        self._validate_logprobs()
        self._validate_penalties()
        self._validate_token_controls()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
        )

    def _validate_branches(self) -> None:
        """How many sequences: ``n`` and ``best_of``."""
        _check(
            _is_int(self.n) and 1 <= self.n <= MAX_N,
            "n",
            f"must be an integer in [1, {MAX_N}], got {self.n!r}",
        )
        if self.best_of is not None:
            _check(
                _is_int(self.best_of) and self.n <= self.best_of <= MAX_N,
                "best_of",
                f"must be an integer in [n ({self.n}), {MAX_N}], got {self.best_of!r}",
            )

    def _validate_sampling(self) -> None:
        """How a token is drawn: temperature, the top-p / top-k / min-p filters, the seed."""
        _check(
            _is_finite(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be a finite number >= 0, got {self.temperature!r}",
        )
        _check(
            _is_finite(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        if self.top_k is not None:
            _check(
                _is_int(self.top_k) and self.top_k >= 1,
                "top_k",
                f"must be None, -1 or 0 (no limit), or an integer >= 1, got {self.top_k!r}",
            )
        _check(
            _is_finite(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            f"must be in [0, 1], got {self.min_p!r}",
        )
        if self.seed is not None:  # what a torch.Generator takes
            _check(
                _is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX,
                "seed",
                f"must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}",
            )

    def _validate_stopping(self) -> None:
        """When a sequence ends: token counts, stop strings and stop tokens."""
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 0,
            "max_tokens",
            f"must be None or an integer >= 1 (0 with prompt_logprobs), got {self.max_tokens!r}",
        )
        _check(
            self.max_tokens > 0 or self.prompt_logprobs is not None,
            "max_tokens",
            "0 generates nothing, so it is allowed only with prompt_logprobs (to score the prompt)",
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be an integer in [0, max_tokens], got {self.min_tokens!r}",
        )
        _check(
            all(_is_text(s) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            "stop",
            f"must be non-empty strings of valid Unicode, at most {MAX_STOP_STRING_CHARS} "
            "characters each",
        )
        _check(
            all(_is_token_id(t) for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}",
            )

    def _validate_token_controls(self) -> None:
        """``allowed_token_ids`` and ``bad_words`` (``logit_bias`` is checked as it is read)."""
        if self.allowed_token_ids is not None:
            _check(bool(self.allowed_token_ids), "allowed_token_ids", "must not be empty")
            _check(
                all(_is_token_id(t) for t in self.allowed_token_ids),
                "allowed_token_ids",
                "must be non-negative integers",
            )
        _check(
            all(_is_text(w) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words),
            "bad_words",
            f"must be strings of valid Unicode with a non-space character, at most "
            f"{MAX_BAD_WORD_CHARS} characters each",
        )

    def _validate_penalties(self) -> None:
        """Presence and frequency penalties in [-2, 2]; a positive repetition penalty."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _is_finite(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                name,
                f"must be a number in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}",
            )
        _check(
            _is_finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be a finite number > 0, got {self.repetition_penalty!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def num_branches(self) -> int:
        """How many sequences the request generates (``best_of`` if set, else ``n``)."""
        return self.best_of if self.best_of is not None else self.n
