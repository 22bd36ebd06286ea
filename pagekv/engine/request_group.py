"""What the user sees of a request: its branches' text, tokens, logprobs and finish reasons.

Owns: one ``RequestGroup`` per user request (n branches; more when best_of > n), each branch's
incremental detokenizer and ``CompletionOutput``. The engine feeds sampled tokens in and asks
for ``RequestOutput`` snapshots; queues and blocks stay with the scheduler and KV manager.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from pagekv.core.request import Request, RequestStatus
from pagekv.engine.detokenizer import IncrementalDetokenizer
from pagekv.engine.outputs import CompletionOutput, RequestOutput
from pagekv.models.tokenizer import Tokenizer
from pagekv.runner.model_runner import SampledToken
from pagekv.sampling_params import SamplingParams

FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class Branch:
    """One generated sequence of a group and what the user will see of it."""

    request: Request
    detok: IncrementalDetokenizer
    output: CompletionOutput

    def on_token(self, token: SampledToken, finished: bool) -> bool:
        """Record a sampled token; True if a stop string now ends the branch."""
        out, params = self.output, self.request.params
        out.token_ids.append(token.token_id)
        if out.logprobs is not None and token.logprob is not None:
            entry = {token.token_id: token.logprob}
            entry.update(dict(token.top_logprobs or []))
            out.logprobs.append(entry)
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + token.logprob
        is_stop_token = finished and self.request.status is RequestStatus.FINISHED_STOPPED
        skip_text = is_stop_token and not params.include_stop_str_in_output
        delta = "" if skip_text else self.detok.append(token.token_id)
        out.text = self.detok.text
        if finished:
            out.finish_reason = FINISH_REASON[self.request.status]
            if token.token_id in params.stop_token_ids:
                out.stop_reason = token.token_id
            return False
        stop = self.detok.find_stop(params.stop, len(delta)) if delta else None
        if stop is None:
            return False
        text, at = stop
        self.detok.truncate(at + len(text) if params.include_stop_str_in_output else at)
        out.text = self.detok.text
        out.stop_reason = text
        return True


@dataclass
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    branches: list[Branch] = field(default_factory=list)
    num_returned: int = 1  # n; fewer than the branches when best_of > n
    hide_logprobs: bool = False  # computed only to rank best_of branches
    arrival_time: float = field(default_factory=time.time)  # wall clock, for the trace

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: tuple[str | None, list[int]],
        params: SamplingParams,
        tokenizer: Tokenizer,
        placement: tuple[str | None, int, str | None],
    ) -> RequestGroup:
        """The group and its branch requests; ``placement``: (cache_salt, priority, client)."""
        text, ids = prompt
        group = cls(request_id, text, ids, num_returned=params.n)
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
                cache_salt=placement[0],
                priority=placement[1],
                eos_token_ids=tokenizer.eos_token_ids,
                client=placement[2],
            )
            logprobs = branch_params.logprobs is not None
            output = CompletionOutput(
                index=i,
                text="",
                token_ids=[],
                logprobs=[] if logprobs else None,
                cumulative_logprob=0.0 if logprobs else None,
            )
            detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
            group.branches.append(Branch(request, detok, output))
        return group

    @property
    def finished(self) -> bool:
        return all(b.output.finished for b in self.branches)

    def to_output(self) -> RequestOutput:
        outputs = [replace(b.output, token_ids=list(b.output.token_ids)) for b in self.branches]
        if self.num_returned < len(outputs):
            # best_of: nothing streams; at the end, the n branches of highest cumulative logprob.
            ranked = sorted(outputs, key=lambda o: -(o.cumulative_logprob or 0.0))
            outputs = ranked[: self.num_returned] if self.finished else []
            for i, out in enumerate(outputs):
                out.index = i
                if self.hide_logprobs:
                    out.logprobs = out.cumulative_logprob = None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.branches[0].request.num_cached_prompt_tokens,
        )
