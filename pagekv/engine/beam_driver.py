"""Runs beam-search groups inside the engine's continuous batching.

Owns: the live beam groups (``BeamGroup`` state plus their ``Request`` objects) and the reports
of the current step. Each beam is an ordinary request to the scheduler (greedy, with its top 2W
logprobs); after a step the driver lets the group select survivors and applies the choice:
replace a survivor's last (not yet computed) token, fork a beam chosen twice, finish a beam not
chosen. Beams of a group normally report in the same step; one that reports early is held
until its siblings have reported (e.g. after a preemption).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from pagekv.core.request import Request, RequestStatus
from pagekv.core.scheduler import Scheduler
from pagekv.engine.beam_search import (
    BeamGroup,
    BeamHypothesis,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    Continuation,
    TopTokens,
)
from pagekv.engine.detokenizer import Decoder
from pagekv.engine.outputs import Logprob
from pagekv.sampling_params import SamplingParams

Release = Callable[[str], None]


@dataclass
class _Run:
    request_id: str
    prompt_token_ids: list[int]
    group: BeamGroup
    requests: dict[str, Request]
    reports: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))


class BeamDriver:
    """Owner of the engine's beam-search groups."""

    def __init__(self, scheduler: Scheduler, tokenizer: Decoder, release: Release) -> None:
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._release = release
        self._runs: dict[str, _Run] = {}
        self._run_of: dict[str, _Run] = {}  # beam request id -> its group

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._runs

    def owns(self, beam_request_id: str) -> bool:
        return beam_request_id in self._run_of

    def __len__(self) -> int:
        return len(self._runs)

    def add(
        self, request_id: str, ids: list[int], params: BeamSearchParams, eos: tuple[int, ...]
    ) -> None:
        width = params.beam_width
        sampling = SamplingParams(
            temperature=0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=2 * width
        )
        root = Request(request_id, ids, sampling)
        group = BeamGroup(params, eos, [request_id], {request_id: 0.0}, {request_id: []})
        run = _Run(request_id, ids, group, {request_id: root})
        self._scheduler.add(root)
        self._runs[request_id] = run
        self._run_of[request_id] = run

    def report(self, beam_id: str, top: list[tuple[int, float]]) -> None:
        run = self._run_of[beam_id]
        run.reports[beam_id] = top
        run.requests[beam_id].hold()

    def finish_ready(self) -> list[BeamSearchOutput]:
        """Select survivors in every group whose beams have all reported; return ended groups."""
        outputs = []
        for run in list(self._runs.values()):
            if not run.reports or set(run.reports) != set(run.group.beams):
                continue
            reports, run.reports = run.reports, {}
            survivors = run.group.select(reports)
            if run.group.done:
                outputs.append(self._end(run))
            else:
                self._apply(run, survivors, reports)
        return outputs

    def abort(self, request_id: str) -> bool:
        run = self._runs.get(request_id)
        if run is None:
            return False
        self._end(run)
        return True

    def _apply(
        self, run: _Run, survivors: list[Continuation], reports: dict[str, TopTokens]
    ) -> None:
        placed: list[tuple[str, Continuation]] = []
        used: set[str] = set()
        for cont in survivors:
            parent = run.requests[cont.parent]
            if cont.parent not in used:
                used.add(cont.parent)
                parent.replace_last_token(cont.token_id)  # not computed yet: free to replace
                placed.append((cont.parent, cont))
                continue
            child_id = f"{run.request_id}#beam{next(run.ids)}"
            run.requests[child_id] = parent.branch_off(child_id, cont.token_id)
            self._run_of[child_id] = run
            placed.append((child_id, cont))
        keep = {rid for rid, _ in placed}
        for rid in [r for r in run.requests if r not in keep]:
            self._drop(run, rid)
        for rid in used:
            parent = run.requests[rid]
            parent.release_hold()
            if parent.fork_children:
                self._scheduler.fork(parent)
        run.group.advance(placed, reports)

    def _drop(self, run: _Run, beam_id: str) -> None:
        request = run.requests.pop(beam_id)
        self._run_of.pop(beam_id, None)
        self._scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._release(beam_id)

    def _end(self, run: _Run) -> BeamSearchOutput:
        for beam_id in list(run.requests):
            self._drop(run, beam_id)
        del self._runs[run.request_id]
        sequences = [self._sequence(run, h) for h in run.group.result()]
        return BeamSearchOutput(run.request_id, run.prompt_token_ids, sequences)

    def _sequence(self, run: _Run, hypothesis: BeamHypothesis) -> BeamSearchSequence:
        """A hypothesis as vLLM names it: the prompt's tokens then its own, their text."""
        tokens = [*run.prompt_token_ids, *hypothesis.token_ids]
        skip = run.group.params.skip_special_tokens
        return BeamSearchSequence(
            tokens=tokens,
            logprobs=[self._logprobs(top) for top in hypothesis.tops],
            cum_logprob=hypothesis.cumulative_logprob,
            text=self._tokenizer.decode(tokens, skip_special_tokens=skip),
            finish_reason="length" if hypothesis.stop_token is None else "stop",
            stop_reason=hypothesis.stop_token,
            score=hypothesis.score,
            num_prompt_tokens=len(run.prompt_token_ids),
        )

    def _logprobs(self, top: TopTokens) -> dict[int, Logprob]:
        decode = self._tokenizer.decode
        return {
            token: Logprob(lp, rank, decode([token], skip_special_tokens=False))
            for rank, (token, lp) in enumerate(top, start=1)
        }
