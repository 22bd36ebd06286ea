"""Under the fair policy, a step's prefill tokens shared among clients (``Request.client``).

Without it, the first running prefill takes the whole step budget and one client's long
prompts hold every other client's short one to a token a step, and stretch every step its
decodes take part in. So, while requests of more than one client are in the scheduler:

- decodes first: one token of the budget per running request that decodes;
- the rest, capped at ``ContendedBudget.tokens``, is split among the clients with prompt
  tokens to compute (running prefills and waiting requests) by water-filling: a client
  needing less than an equal share gets what it needs, the others split the rest equally;
- within a client, its requests take its share in the policy's order.

``ContendedBudget`` keeps such a step short for the clients that decode in it: a step's
prefill tokens, at most ``shared_prefill_tokens``, are steered by the measured step times so
that a contended step takes about ``STEP_RATIO`` times a step of decodes alone (a token costs
far more deep in a long prompt, where it attends to all before it, than near its start).

With one client (every offline run) nothing changes: no shares, no cap. Must not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from pagekv.core.plan import Plan
from pagekv.core.policy import SchedulingPolicy
from pagekv.core.request import Request
from pagekv.core.scheduler_config import SchedulerConfig

K = TypeVar("K")


def waterfill(demand: Mapping[K, int], total: int) -> dict[K, int]:
    """``total`` split over ``demand``'s keys: each gets min(its demand, an equal share of what
    the smaller demands left)."""
    shares: dict[K, int] = {}
    left = total
    ordered = sorted(demand.items(), key=lambda item: item[1])
    for i, (key, need) in enumerate(ordered):
        give = min(need, left // (len(ordered) - i))
        shares[key] = give
        left -= give
    return shares


STEP_RATIO = 2.0  # a contended step against a step of decodes alone
MIN_SHARED_TOKENS = 16
DECODE_EMA = 0.2  # weight of the newest decode-only step in the average


class ContendedBudget:
    """A contended step's prefill tokens, steered by step times (module docstring). Owner of
    the estimate of a decode-only step and of the current budget."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.cap = config.shared_prefill_tokens
        self.tokens = self.cap
        self.decode_s: float | None = None
        self._started: tuple[float, bool] | None = None  # the step's start, contended?

    def shares(
        self, running: Sequence[Request], waiting: Iterable[Request], budget: int, now: float
    ) -> dict[str | None, int] | None:
        """This step's ``prefill_shares`` (a step starting ``now``)."""
        shares = prefill_shares(running, waiting, budget, self.config, self.tokens)
        self._started = (now, shares is not None)
        return shares

    def step_done(self, plan: Plan, now: float) -> None:
        if self._started is not None:
            started, contended = self._started
            prefill = sum(e.num_tokens for e in plan.scheduled if e.num_tokens > 1)
            self.observe(now - started, prefill, contended)
            self._started = None

    def observe(self, seconds: float, prefill_tokens: int, contended: bool) -> None:
        """A step took ``seconds``: a decode-only one updates the estimate; a contended one
        with prefill moves the budget toward STEP_RATIO times it (at most x2 or /2 a step)."""
        if prefill_tokens == 0:
            last = self.decode_s
            self.decode_s = seconds if last is None else last + DECODE_EMA * (seconds - last)
        elif contended and self.decode_s is not None and self.cap > 0:
            scale = STEP_RATIO * self.decode_s / max(seconds, 1e-6)
            tokens = int(self.tokens * min(max(scale, 0.5), 2.0))
            self.tokens = min(self.cap, max(MIN_SHARED_TOKENS, tokens))


def prefill_shares(
    running: Sequence[Request],
    waiting: Iterable[Request],
    budget: int,
    config: SchedulerConfig,
    cap: int,
) -> dict[str | None, int] | None:
    """Each client's prefill tokens for this step, or None (no sharing) unless the policy is
    fair and requests of 2+ clients are in. ``running`` in the policy's order; ``cap``: the
    step's prefill tokens at most (0: no cap)."""
    if config.policy is not SchedulingPolicy.FAIR:
        return None
    demand: dict[str | None, int] = {}
    clients: set[str | None] = set()
    decodes = 0
    for request in running[: config.max_num_seqs]:
        clients.add(request.client)
        left = request.num_target_tokens - request.num_computed_tokens
        if left > 1:
            demand[request.client] = demand.get(request.client, 0) + left
        elif left == 1:
            decodes += 1
    for request in waiting:
        clients.add(request.client)
        left = request.num_target_tokens - request.num_computed_tokens
        demand[request.client] = demand.get(request.client, 0) + max(left, 1)
    if len(clients) < 2:
        return None
    total = max(budget - decodes, 0)
    if cap > 0:
        total = min(total, cap)
    return waterfill(demand, total)


def take_share(shares: dict[str | None, int], client: str | None, num_new: int) -> int:
    """``num_new`` within the client's share of this step's prefill, taken from it."""
    num_new = min(num_new, shares.get(client, 0))
    if num_new > 0:
        shares[client] -= num_new
    return num_new
