"""What the user sees of a request: its branches' text, tokens, logprobs and finish reasons.

Owns: one ``RequestGroup`` per user request (n branches; more when best_of > n), each branch's
incremental detokenizer and ``CompletionOutput``, the group's prompt logprobs as they arrive
(``PromptScores``) and its timings (``RequestStateStats``). The engine feeds sampled tokens in
and asks for ``RequestOutput`` snapshots; queues and blocks stay with the scheduler and KV
manager.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pagekv.core.request import Request, RequestStatus
from pagekv.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from pagekv.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
    RequestStateStats,
)
from pagekv.errors import InvalidRequestError
from pagekv.models.tokenizer import Tokenizer
from pagekv.runner.model_runner import PromptLogprobsChunk, SampledToken
from pagekv.sampling_params import SamplingParams

FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def position_logprobs(
    texts: TokenTexts,
    token: tuple[int, float, int | None],
    top: Sequence[tuple[int, float]],
    context: Sequence[int],
) -> PositionLogprobs:
    """vLLM's entry for one position: ``token`` (id, logprob, rank) first, then the top
    alternatives ranked 1..k (the token among them takes its place in the ranking, as in
    vLLM's dict); each spelled after ``context``, the tokens before the position."""
    token_id, logprob, rank = token
    entry = {token_id: Logprob(logprob, rank, texts(token_id, context))}
    for i, (alt, alt_logprob) in enumerate(top, start=1):
        entry[alt] = Logprob(alt_logprob, i, texts(alt, context))
    return entry


@dataclass
class PromptScores:
    """A group's prompt logprobs: one entry per prompt position after the first, filled as the
    prefill's chunks report them (a chunk computed again after a preemption overwrites its
    positions with the same numbers)."""

    prompt_token_ids: list[int]
    texts: TokenTexts
    entries: list[PositionLogprobs | None] = field(default_factory=list)
    num_filled: int = 0

    def __post_init__(self) -> None:
        self.entries = [None] * len(self.prompt_token_ids)

    @property
    def complete(self) -> bool:
        return self.num_filled >= len(self.prompt_token_ids) - 1

    def add(self, chunk: PromptLogprobsChunk) -> None:
        """Record a chunk: its row j scores prompt token ``chunk.start_position + j + 1``."""
        ids = self.prompt_token_ids
        rows = zip(chunk.logprobs, chunk.ranks, chunk.top, strict=True)
        for j, (logprob, rank, top) in enumerate(rows):
            position = chunk.start_position + j + 1
            context = ids[max(1, position - 4) : position]  # vLLM's: scored tokens before it
            if self.entries[position] is None:
                self.num_filled += 1
            token = (ids[position], logprob, rank)
            self.entries[position] = position_logprobs(self.texts, token, top, context)

    def result(self) -> list[PositionLogprobs | None] | None:
        """The whole list once every position is in (None for the first token), else None."""
        return list(self.entries) if self.complete else None


@dataclass
class Branch:
    """One generated sequence of a group and what the user will see of it."""

    request: Request
    detok: IncrementalDetokenizer
    output: CompletionOutput
    texts: TokenTexts

    def on_token(self, token: SampledToken, finished: bool) -> bool:
        """Record a sampled token; True if a stop string now ends the branch."""
        out, params = self.output, self.request.params
        if out.logprobs is not None and token.logprob is not None:
            chosen = (token.token_id, token.logprob, token.rank)
            context = out.token_ids[-4:]  # the sampled tokens before it (vLLM's context)
            out.logprobs.append(
                position_logprobs(self.texts, chosen, token.top_logprobs or [], context)
            )
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + token.logprob
        out.token_ids.append(token.token_id)
        is_stop_token = finished and self.request.status is RequestStatus.FINISHED_STOPPED
        skip_text = is_stop_token and not params.include_stop_str_in_output
        delta = "" if skip_text else self.detok.append(token.token_id)
        stop = self.detok.find_stop(params.stop, len(delta)) if delta else None
        if stop is not None:  # also in the token that ends it otherwise (its last, by length)
            text, at = stop
            self.detok.truncate(at + len(text) if params.include_stop_str_in_output else at)
            out.stop_reason = text
        out.text = self.detok.text
        if finished:
            out.finish_reason = "stop" if stop is not None else FINISH_REASON[self.request.status]
            if stop is None and token.token_id in params.stop_token_ids:
                out.stop_reason = token.token_id
        return stop is not None and not finished


def bad_words_token_ids(
    tokenizer: Tokenizer, words: Sequence[str], vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """``SamplingParams.bad_words`` as token sequences, as vLLM tokenizes them: each word
    (leading spaces stripped) alone, and with one leading space where that gives a different
    first token and as many tokens (the word in the middle of text). InvalidRequestError
    naming ``bad_words`` for a word of no tokens or of tokens outside the model's vocabulary."""
    found: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise InvalidRequestError(f"bad_words: {word!r:.80} has no tokens", "bad_words")
        found.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            found.append(spaced)
    outside = sorted({t for word in found for t in word if not 0 <= t < vocab_size})
    if outside:
        raise InvalidRequestError(
            f"bad_words: token ids {outside[:8]} are outside the vocabulary [0, {vocab_size})",
            "bad_words",
        )
    return tuple(found)


@dataclass(frozen=True)
class GroupSetup:
    """What the engine gives every group besides its prompt and params."""

    tokenizer: Tokenizer
    texts: TokenTexts
    cache_salt: str | None = None
    priority: int = 0
    client: str | None = None  # whose request (the fair policy's turns)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    branches: list[Branch] = field(default_factory=list)
    num_returned: int = 1  # n; fewer than the branches when best_of > n
    hide_logprobs: bool = False  # computed only to rank best_of branches
    arrival_time: float = field(default_factory=time.time)  # wall clock (trace, metrics)
    prompt_scores: PromptScores | None = None  # when prompt_logprobs are asked for
    stats: RequestStateStats = field(default_factory=RequestStateStats)

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: tuple[str | None, list[int]],
        params: SamplingParams,
        setup: GroupSetup,
    ) -> RequestGroup:
        """The group and its branch requests."""
        text, ids = prompt
        group = cls(request_id, text, ids, num_returned=params.n)
        group.stats = RequestStateStats(arrival_time=group.arrival_time, queued_ts=time.monotonic())
        if params.prompt_logprobs is not None:
            group.prompt_scores = PromptScores(ids, setup.texts)
        # best_of ranks branches by cumulative logprob, so every branch computes it.
        ranked = params.num_branches > params.n
        group.hide_logprobs = ranked and params.logprobs is None
        base = replace(params, logprobs=params.logprobs or 0) if ranked else params
        for i in range(params.num_branches):
            branch_params = base if params.seed is None else replace(base, seed=params.seed + i)
            rid = request_id if params.num_branches == 1 else f"{request_id}#{i}"
            request = Request(
                rid,
                ids,
                branch_params,
                cache_salt=setup.cache_salt,
                priority=setup.priority,
                eos_token_ids=setup.tokenizer.eos_token_ids,
                client=setup.client,
                bad_words_token_ids=setup.bad_words_token_ids,
            )
            logprobs = branch_params.logprobs is not None
            output = CompletionOutput(
                index=i,
                text="",
                token_ids=[],
                logprobs=[] if logprobs else None,
                cumulative_logprob=0.0 if logprobs else None,
            )
            detok = IncrementalDetokenizer(setup.tokenizer, params.skip_special_tokens)
            group.branches.append(Branch(request, detok, output, setup.texts))
        return group

    @property
    def finished(self) -> bool:
        return all(b.output.finished for b in self.branches)

    def needs_prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt position reports, while some are missing."""
        scores = self.prompt_scores
        if scores is None or scores.complete:
            return None
        return self.branches[0].request.params.prompt_logprobs

    def on_scheduled(self, now: float) -> None:
        """The group's requests ran a step (the first time sets ``scheduled_ts``)."""
        if self.stats.scheduled_ts == 0.0:
            self.stats.scheduled_ts = now

    def on_tokens(self, now: float, corrupted: bool = False) -> None:
        """Tokens arrived this step (or the logits went non-finite)."""
        stats = self.stats
        if stats.first_token_ts == 0.0:
            stats.first_token_ts = now
            stats.first_token_latency = time.time() - self.arrival_time
        stats.last_token_ts = now
        stats.is_corrupted = stats.is_corrupted or corrupted

    def to_output(self) -> RequestOutput:
        outputs = [replace(b.output, token_ids=list(b.output.token_ids)) for b in self.branches]
        for out in outputs:
            if out.logprobs is not None:
                out.logprobs = list(out.logprobs)
        if self.num_returned < len(outputs):
            # best_of: nothing streams; at the end, the n branches of highest cumulative logprob.
            ranked = sorted(outputs, key=lambda o: -(o.cumulative_logprob or 0.0))
            outputs = ranked[: self.num_returned] if self.finished else []
            for i, out in enumerate(outputs):
                out.index = i
                if self.hide_logprobs:
                    out.logprobs = out.cumulative_logprob = None
        stats = replace(
            self.stats,
            num_generation_tokens=sum(len(b.output.token_ids) for b in self.branches),
            num_preemptions=sum(b.request.num_preemptions for b in self.branches),
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.branches[0].request.num_cached_prompt_tokens,
            prompt_logprobs=None if self.prompt_scores is None else self.prompt_scores.result(),
            metrics=stats,
        )
