"""The scheduler's settings and counters: a frozen, validated config and a flat dataclass of ints.

Owns nothing live: ``SchedulerConfig`` is validated once and frozen; ``SchedulerCounters`` is
owned (and only written) by the ``Scheduler``. The engine exports every counter field under its
own name (``dataclasses.asdict``), so it stays flat and all ints. Must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from pagekv.core.policy import SchedulingPolicy
from pagekv.core.preemption import PreemptionCostModel, PreemptionMode
from pagekv.core.tier_policy import LoadCostModel
from pagekv.errors import InvalidRequestError

E = TypeVar("E", bound=Enum)


def _enum(kind: type[E], value: object, param: str) -> E:
    """``value`` as a member of ``kind`` (members and their string values accepted)."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        allowed = [m.value for m in kind]
        raise InvalidRequestError(
            f"{param} must be one of {allowed}, got {value!r}", param
        ) from None


def _check_int(value: object, param: str, minimum: int, bound: str | None = None) -> None:
    """``value`` must be an int (not a bool) >= ``minimum`` (named ``bound`` in the message)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequestError(
            f"{param} must be an integer >= {bound or minimum}, got {value!r}", param
        )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class SchedulerConfig:
    """Validated once; unknown policy or mode strings are rejected, not ignored."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # the per-step token budget
    max_model_len: int = 8192
    block_size: int = 16  # must equal the KV manager's
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    priority_aging_steps: int = 100  # a waiting request gains 1 priority level per this; 0: off
    long_prefill_token_threshold: int = 0  # per-request per-step chunk cap; 0: no cap
    # Under the fair policy, while requests of 2+ clients are in: a step's prefill tokens at
    # most (0: no cap), shared among the clients (fair_share.py)
    shared_prefill_tokens: int = 256
    # A step with prompt tokens kept to about this long (step_budget.py); 0: off
    prefill_step_seconds: float = 0.0
    watermark: float = 0.01  # share of the pool kept free when admitting
    cost_model: PreemptionCostModel = field(default_factory=PreemptionCostModel)
    preemption_log_interval_s: float = 10.0  # at most one preemption log line per interval
    load_cost: LoadCostModel = field(default_factory=LoadCostModel)  # wait for storage or not
    # Speculative decoding by n-gram lookup (speculation.py): draft tokens per greedy decode
    # (0: off), and the longest and shortest suffix looked up in the request's history.
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        mode = _enum(PreemptionMode, self.preemption_mode, "preemption_mode")
        object.__setattr__(self, "preemption_mode", mode)
        object.__setattr__(self, "policy", _enum(SchedulingPolicy, self.policy, "policy"))
        _check_int(self.block_size, "block_size", 1)
        _check_int(self.max_num_seqs, "max_num_seqs", 1)
        _check_int(
            self.max_num_batched_tokens,
            "max_num_batched_tokens",
            self.block_size,
            f"block_size ({self.block_size}): the per-step token budget must hold one block",
        )
        _check_int(self.max_model_len, "max_model_len", 1)
        _check_int(self.priority_aging_steps, "priority_aging_steps", 0)
        _check_int(self.long_prefill_token_threshold, "long_prefill_token_threshold", 0)
        _check_int(self.shared_prefill_tokens, "shared_prefill_tokens", 0)
        if not _is_number(self.prefill_step_seconds) or not 0 <= self.prefill_step_seconds < 1e6:
            raise InvalidRequestError(
                f"prefill_step_seconds must be >= 0, got {self.prefill_step_seconds!r}",
                "prefill_step_seconds",
            )
        _check_int(self.num_speculative_tokens, "num_speculative_tokens", 0)
        _check_int(self.prompt_lookup_min, "prompt_lookup_min", 1)
        _check_int(self.prompt_lookup_max, "prompt_lookup_max", self.prompt_lookup_min)
        if not _is_number(self.watermark) or not 0 <= self.watermark < 1:
            raise InvalidRequestError(
                f"watermark must be in [0, 1), got {self.watermark!r}", "watermark"
            )
        if not isinstance(self.load_cost, LoadCostModel):
            raise InvalidRequestError("load_cost must be a LoadCostModel", "load_cost")
        if not isinstance(self.cost_model, PreemptionCostModel):
            raise InvalidRequestError("cost_model must be a PreemptionCostModel", "cost_model")
        interval = self.preemption_log_interval_s
        if not _is_number(interval) or interval < 0:
            raise InvalidRequestError(
                f"preemption_log_interval_s must be >= 0, got {interval!r}",
                "preemption_log_interval_s",
            )


@dataclass
class SchedulerCounters:
    """Monotonic counters; the engine exports each field under its own name. Flat ints only.

    At any moment: ``added_requests == finished_requests + aborted_requests + unfinished``
    (a branch of n > 1 or a beam counts once forked), and ``preemptions_swap ==
    swapped_in_requests + len(swapped) + requests aborted while swapped out``.
    """

    added_requests: int = 0  # by add, or forked off a parent
    finished_requests: int = 0  # stop or length
    aborted_requests: int = 0
    rejected_requests: int = 0  # can never fit the context or the pool
    preemptions_recompute: int = 0  # including swap fallbacks
    preemptions_swap: int = 0
    swap_fallbacks: int = 0  # swap chosen, host pool full or absent: recomputed instead
    preemption_swapped_blocks: int = 0  # blocks moved to the host pool by swap preemptions
    swapped_in_requests: int = 0
    recomputed_tokens: int = 0  # computed tokens dropped by recompute preemptions
    load_waits: int = 0  # requests held back while their prefix is fetched from storage
    loads_arrived: int = 0  # ... whose prefetch arrived in time
    load_give_ups: int = 0  # ... that stopped waiting at the deadline and recomputed
    load_skipped: int = 0  # storage had their prefix, but recomputing was estimated faster
    draft_tokens: int = 0  # tokens drafted by n-gram lookup and checked by the model
    accepted_draft_tokens: int = 0  # ... that the model agreed with (kept as output)
