"""Beam search over shared KV blocks: the parameters, one group's state, and its selection step.

Owns: a beam group's live beams (their request ids, in rank order), their cumulative log-probs,
and the pool of finished hypotheses. It decides which (beam, token) continuations survive; the
engine applies the decision through the scheduler: a surviving beam keeps its request (its last,
not yet computed token is replaced), a beam chosen twice is forked (its blocks shared, ref count
+1), a beam not chosen is finished (its blocks freed). No torch.

The selection follows Hugging Face transformers' beam search, so results can be compared
token for token (``generate(num_beams=W, do_sample=False, length_penalty=..,
early_stopping=..)``):

    candidates   every live beam's top 2W next tokens, scored cum_logprob + logprob; best 2W
    finished     a candidate among the best W that ends (eos, or max_tokens reached) joins the
                 pool with score cum_logprob / generated_len ** length_penalty; the pool keeps W
    running      the best W candidates that do not end
    stop         the pool is full and early_stopping is True; or no running beam can beat the
                 pool's worst (the length heuristic); or max_tokens is reached

Outputs are named as vLLM's (``BeamSearchOutput.sequences[i].tokens / .text / .cum_logprob /
.logprobs``): ``tokens`` and ``text`` hold the prompt and the generated tokens, as vLLM's do;
``token_ids`` (generated only), ``cumulative_logprob`` and ``score`` are pagekv's own names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import MAX_LOGPROBS

TopTokens = list[tuple[int, float]]  # one step's best (token id, logprob), best first


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    ignore_eos: bool = False
    temperature: float = 0.0
    include_stop_str_in_output: bool = False  # vLLM's; beam search has no stop strings
    skip_special_tokens: bool = True  # for the sequences' text
    structured_outputs: Any = None  # vLLM's; not taken with beam search here

    def __post_init__(self) -> None:
        max_width = MAX_LOGPROBS // 2
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= max_width:
            raise InvalidRequestError(
                f"beam_width must be an integer in [1, {max_width}], got {self.beam_width!r}",
                "beam_width",
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens"
            )
        if not (
            isinstance(self.length_penalty, int | float)
            and not isinstance(self.length_penalty, bool)
            and math.isfinite(self.length_penalty)
        ):
            raise InvalidRequestError(
                f"length_penalty must be a finite number, got {self.length_penalty!r}",
                "length_penalty",
            )
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequestError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}",
                "early_stopping",
            )
        if self.structured_outputs is not None:
            raise InvalidRequestError(
                "structured_outputs: not taken with beam search here (use SamplingParams)",
                "structured_outputs",
            )
        if self.temperature != 0:
            raise InvalidRequestError(
                "beam search is deterministic: temperature must be 0 "
                "(use SamplingParams(n=..., temperature=...) for sampled branches)",
                "temperature",
            )


@dataclass(frozen=True)
class BeamHypothesis:
    """A finished hypothesis inside a group: its generated tokens and each step's top tokens."""

    token_ids: list[int]  # generated tokens (an ending eos included)
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    tops: list[TopTokens]  # per generated token: the parent beam's best tokens that step
    stop_token: int | None  # the eos token that ended it; None: max_tokens did


@dataclass
class BeamSearchSequence:
    """One finished hypothesis of ``BeamSearchOutput.sequences`` (best first), named as vLLM's:
    ``tokens`` are the prompt's then the generated ones, ``text`` their text; ``logprobs`` has
    one entry per generated token (that step's best tokens of the beam, as ``Logprob``s)."""

    tokens: list[int]
    logprobs: list[dict[int, Any]]
    cum_logprob: float
    text: str | None
    finish_reason: str  # "stop" (an eos token) or "length"
    stop_reason: int | None  # the eos token id that ended it
    score: float  # pagekv's: cum_logprob / generated length ** length_penalty
    num_prompt_tokens: int

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens only (pagekv's name)."""
        return self.tokens[self.num_prompt_tokens :]

    @property
    def cumulative_logprob(self) -> float:
        return self.cum_logprob


BeamSequence = BeamSearchSequence  # the name before vLLM's


@dataclass
class BeamSearchOutput:
    request_id: str
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]


@dataclass(frozen=True)
class Continuation:
    """A surviving beam for the next step: ``parent``'s tokens plus ``token_id``."""

    parent: str
    token_id: int
    cumulative_logprob: float


@dataclass
class BeamGroup:
    """One beam search request. ``beams`` are live request ids in rank order."""

    params: BeamSearchParams
    eos_token_ids: tuple[int, ...]
    beams: list[str]
    scores: dict[str, float]
    tokens: dict[str, list[int]]  # generated tokens of each live beam, before this step's
    tops: dict[str, list[TopTokens]] = field(default_factory=dict)  # each live beam's steps
    finished: list[BeamHypothesis] = field(default_factory=list)
    can_improve: bool = True
    done: bool = False

    def select(self, top: dict[str, TopTokens]) -> list[Continuation]:
        """One step: ``top[beam]`` are that beam's best (token, logprob) pairs."""
        width, params = self.params.beam_width, self.params
        gen_len = len(self.tokens[self.beams[0]]) + 1
        cands = [
            (self.scores[b] + lp, rank, tok, b)
            for rank, b in enumerate(self.beams)
            for tok, lp in top[b]
        ]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        cands = cands[: 2 * width]
        is_last = gen_len >= params.max_tokens
        ends = [is_last or (not params.ignore_eos and c[2] in self.eos_token_ids) for c in cands]
        pool_full = len(self.finished) >= width and params.early_stopping is True
        if self.can_improve and not pool_full:
            for i, (cand, end) in enumerate(zip(cands, ends, strict=True)):
                if end and i < width:
                    self._add_finished(cand[3], cand[2], cand[0], top[cand[3]])
        running = [
            Continuation(c[3], c[2], c[0]) for c, end in zip(cands, ends, strict=True) if not end
        ][:width]
        self._update_stop(running, gen_len, is_last)
        return [] if self.done else running

    def _add_finished(self, beam: str, token: int, cum: float, top: TopTokens) -> None:
        tokens = [*self.tokens[beam], token]
        score = cum / len(tokens) ** self.params.length_penalty
        eos = not self.params.ignore_eos and token in self.eos_token_ids
        tops = [*self.tops.get(beam, []), top]
        self.finished.append(BeamHypothesis(tokens, cum, score, tops, token if eos else None))
        self.finished.sort(key=lambda s: -s.score)
        del self.finished[self.params.beam_width :]

    def _update_stop(self, running: list[Continuation], gen_len: int, is_last: bool) -> None:
        params, width = self.params, self.params.beam_width
        full = len(self.finished) >= width
        if running and full:
            never = params.early_stopping == "never" and params.length_penalty > 0
            best_len = params.max_tokens if never else gen_len
            best = running[0].cumulative_logprob / best_len**params.length_penalty
            self.can_improve = self.can_improve and best > self.finished[-1].score
        self.done = (
            is_last
            or not running
            or not self.can_improve
            or (full and params.early_stopping is True)
        )

    def advance(self, survivors: list[tuple[str, Continuation]], top: dict[str, TopTokens]) -> None:
        """Record the new live beams: (request id now holding it, the continuation), and the
        step's best tokens of each parent (``top``, as given to ``select``)."""
        old_tokens, old_tops = self.tokens, self.tops
        self.beams = [rid for rid, _ in survivors]
        self.scores = {rid: c.cumulative_logprob for rid, c in survivors}
        self.tokens = {rid: [*old_tokens[c.parent], c.token_id] for rid, c in survivors}
        self.tops = {rid: [*old_tops.get(c.parent, []), top[c.parent]] for rid, c in survivors}

    def result(self) -> list[BeamHypothesis]:
        return sorted(self.finished, key=lambda s: -s.score)
