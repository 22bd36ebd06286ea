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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    ignore_eos: bool = False
    temperature: float = 0.0

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
        if self.temperature != 0:
            raise InvalidRequestError(
                "beam search is deterministic: temperature must be 0 "
                "(use SamplingParams(n=..., temperature=...) for sampled branches)",
                "temperature",
            )


@dataclass(frozen=True)
class BeamSequence:
    """One finished hypothesis, best first in ``BeamSearchOutput.sequences``."""

    token_ids: list[int]  # generated tokens (an ending eos included)
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    text: str = ""


@dataclass
class BeamSearchOutput:
    request_id: str
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]


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
    finished: list[BeamSequence] = field(default_factory=list)
    can_improve: bool = True
    done: bool = False

    def select(self, top: dict[str, list[tuple[int, float]]]) -> list[Continuation]:
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
                    self._add_finished(cand[3], cand[2], cand[0], gen_len)
        running = [
            Continuation(c[3], c[2], c[0]) for c, end in zip(cands, ends, strict=True) if not end
        ][:width]
        self._update_stop(running, gen_len, is_last)
        return [] if self.done else running

    def _add_finished(self, beam: str, token: int, cum: float, gen_len: int) -> None:
        score = cum / gen_len**self.params.length_penalty
        self.finished.append(BeamSequence([*self.tokens[beam], token], cum, score))
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

    def advance(self, survivors: list[tuple[str, Continuation]]) -> None:
        """Record the new live beams: (request id now holding it, the continuation)."""
        old_tokens = self.tokens
        self.beams = [rid for rid, _ in survivors]
        self.scores = {rid: c.cumulative_logprob for rid, c in survivors}
        self.tokens = {rid: [*old_tokens[c.parent], c.token_id] for rid, c in survivors}

    def result(self) -> list[BeamSequence]:
        return sorted(self.finished, key=lambda s: -s.score)
