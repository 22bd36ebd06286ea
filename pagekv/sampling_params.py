"""How one request is sampled and when it stops: ``SamplingParams`` (pure Python, no torch).

Named and defaulted as vLLM users expect. Validation happens in ``__post_init__`` so an invalid
object never exists: every error is an ``InvalidRequestError`` naming the parameter, raised before
the engine allocates anything. Every number must be finite (no NaN, no infinity); token ids
(``stop_token_ids``) are checked against the vocabulary by the engine, which knows its size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from pagekv.errors import InvalidRequestError

MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed takes
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as in OpenAI's API


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param}: {message}", param=param)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A number that is no NaN or infinity, nor an integer past the range of a float."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


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


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping settings of one request.

    ``temperature == 0`` is greedy. ``top_k=None`` and ``top_p=1`` disable those filters.
    With ``seed`` set, branch ``i`` of an ``n > 1`` request samples with ``seed + i``.
    ``logprobs=k`` returns the chosen token's log-probability and the top ``k`` alternatives,
    all under the model's raw distribution (before penalties, temperature and filters), as vLLM
    does. Penalties, as OpenAI and vLLM define them, change the logits of tokens already seen
    before anything else: ``repetition_penalty`` divides a positive logit (multiplies a
    negative one) of every token in the prompt or the output so far; then each token's logit
    loses ``frequency_penalty`` times its count in the output, and ``presence_penalty`` once if
    it occurs there at all. ``structured_outputs`` constrains the text to a JSON schema, a
    regular expression, a choice or a grammar: tokens that would leave it are never drawn.
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

    def __post_init__(self) -> None:
        # Accept a single stop string or list, as the OpenAI API does; store tuples (frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        """Each field group in turn; the first bad value raises."""
        self._validate_branches()
        self._validate_sampling()
        self._validate_stopping()
        self._validate_logprobs()
        self._validate_penalties()
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
        )

    def _validate_branches(self) -> None:
        """How many sequences: ``n`` and ``best_of``."""
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None:
            _check(
                _is_int(self.best_of) and self.best_of >= self.n,
                "best_of",
                f"must be an integer >= n ({self.n}), got {self.best_of!r}",
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
                f"must be None or an integer >= 1, got {self.top_k!r}",
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
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be an integer in [0, max_tokens], got {self.min_tokens!r}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be non-empty strings",
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )

    def _validate_logprobs(self) -> None:
        if self.logprobs is not None:
            _check(
                _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
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
