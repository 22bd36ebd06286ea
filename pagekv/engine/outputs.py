"""What the engine returns: ``RequestOutput`` with one ``CompletionOutput`` per branch.

Named as vLLM (0.32) users expect: ``Logprob`` entries keyed by token id, ``prompt_logprobs``
and ``metrics`` (vLLM's ``RequestStateStats``). Plain data; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A request whose logits were not finite (NaN or inf: a broken model or kernel, never the
# user's parameters) ends with this reason and no further token; vLLM names it the same.
FINISH_ERROR = "error"


@dataclass
class Logprob:
    """One token's log-probability at one position, as vLLM has it.

    ``rank``: 1 for the most likely token; the chosen (or prompt) token's is the number of
    tokens at least as likely as it, the top alternatives' are 1..k in order. ``decoded_token``:
    the token's text alone (special tokens spelled out)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: the chosen (or prompt) token first, then the top alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence. ``logprobs[i]`` maps token id -> ``Logprob`` for output token i
    (the chosen token, always, plus the requested top alternatives)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None: running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStateStats:
    """A request's timings and counts, under vLLM's names (``RequestOutput.metrics``).

    ``arrival_time`` is wall-clock (``time.time()``); the ``*_ts`` are ``time.monotonic()``
    (vLLM's engine-core timestamps), 0.0 until they happen. ``first_token_latency``: seconds
    from arrival to the first token. ``is_corrupted``: the logits went non-finite."""

    num_generation_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0
    is_corrupted: bool = False


@dataclass
class RequestOutput:
    """A snapshot of one request. ``prompt_logprobs`` (when asked for and the prompt is
    prefilled): None for the first prompt token, then one entry per later prompt token."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestStateStats | None = None
