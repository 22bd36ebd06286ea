"""What the engine returns: ``RequestOutput`` with one ``CompletionOutput`` per branch.

Named as vLLM users expect. Plain data; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A request whose logits were not finite (NaN or inf: a broken model or kernel, never the
# user's parameters) ends with this reason and no further token; vLLM names it the same.
FINISH_ERROR = "error"


@dataclass
class CompletionOutput:
    """One generated sequence. ``logprobs[i]`` maps token id -> logprob for output token i
    (the chosen token plus the requested top alternatives)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None: running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
