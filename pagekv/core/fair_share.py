"""Under the fair policy, a step's prefill tokens shared among clients (``Request.client``).

Without it, the first running prefill takes the whole step budget and one client's long
prompts hold every other client's short one to a token a step, and stretch every step its
decodes take part in. So, while requests of more than one client are in the scheduler:

- decodes first: one token of the budget per running request that decodes;
- the rest, capped at ``StepBudget.tokens(contended=True)``, is split among the clients with prompt
  tokens to compute (running prefills and waiting requests) by water-filling: a client
  needing less than an equal share gets what it needs, the others split the rest equally;
- within a client, its requests take its share in the policy's order.

How many prompt tokens such a step takes in all is ``step_budget.py``'s (about twice a step
of decodes alone, steered by measured step times). With one client (every offline run) no
shares. Must not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

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


class PrefillShares:
    """A step's prompt tokens left: per client (``per_client``), or one pool for all."""

    __slots__ = ("per_client", "pooled")

    def __init__(self, per_client: dict[str | None, int] | None = None, pooled: int = 0) -> None:
        self.per_client = per_client
        self.pooled = pooled

    def left(self, client: str | None) -> int:
        return self.pooled if self.per_client is None else self.per_client.get(client, 0)

    def take(self, client: str | None, num_new: int) -> int:
        """``num_new`` within what is left for ``client``, taken from it."""
        num_new = min(num_new, self.left(client))
        if num_new > 0:
            if self.per_client is None:
                self.pooled -= num_new
            else:
                self.per_client[client] -= num_new
        return num_new


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
