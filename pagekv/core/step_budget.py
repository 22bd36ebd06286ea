"""How many prompt tokens a step computes, steered by how long steps take.

A step cannot be interrupted: its length is how long a request that arrives waits for its first
step, and how long every request decoding in it waits for its next token. What a prompt token
costs varies tenfold and more (deep in a long prompt it attends to everything before it; CPUs
differ), so the limits are set in seconds and turned into tokens by a cost model fitted to the
steps as they run: a step takes ``base_s`` (a step of decodes alone) plus ``token_s`` per prompt
token, both moving averages.

- ``prefill_step_seconds`` (0: off): a step with prompt tokens takes about this long at most,
  or twice a step of decodes alone if that is longer (prompts still get in beside a large batch).
- Contended (the fair policy with requests of 2+ clients in, ``fair_share.py``): about
  ``STEP_RATIO`` times a step of decodes alone, so the clients decoding in it keep their pace,
  and at most ``shared_prefill_tokens``; the tokens are then shared among the clients.

Until a step with prompt tokens has been measured, a step's prompt tokens are capped at
``UNMEASURED_TOKENS``. Owner of the cost model and of the start of the step in flight. Must not
import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagekv.core.fair_share import PrefillShares, prefill_shares
from pagekv.core.plan import Plan
from pagekv.core.request import Request
from pagekv.core.scheduler_config import SchedulerConfig

STEP_RATIO = 2.0  # a contended step against a step of decodes alone
MIN_PREFILL_TOKENS = 1  # a capped step's prompt tokens at least: every prompt moves on
UNMEASURED_TOKENS = 256
BASE_EMA = 0.2  # weight of the newest decode-only step in ``base_s``
TOKEN_EMA = 0.5  # weight of the newest step with prompt tokens (the cost moves with depth)


class StepBudget:
    """A step's prompt tokens at most, per the module docstring."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.base_s: float | None = None  # a step of decodes alone
        self.token_s: float | None = None  # a prompt token, beyond the base
        self._started: float | None = None

    def shares(
        self, running: Sequence[Request], waiting: Iterable[Request], budget: int, now: float
    ) -> PrefillShares | None:
        """This step's prompt tokens (a step starting ``now``): per client when contended,
        one pool under ``prefill_step_seconds``, or None (no limit but the budget)."""
        self._started = now
        split = prefill_shares(running, waiting, budget, self.config, self.tokens(True))
        if split is not None:
            return PrefillShares(split)
        if self.config.prefill_step_seconds > 0:
            return PrefillShares(pooled=self.tokens(False))
        return None

    def tokens(self, contended: bool) -> int:
        """A step's prompt tokens at most (contended: before sharing; 0: no cap)."""
        config = self.config
        ceiling = config.max_num_batched_tokens
        shared_cap = contended and config.shared_prefill_tokens > 0
        if shared_cap:
            ceiling = min(ceiling, config.shared_prefill_tokens)
        spare = self._spare_seconds(shared_cap)
        if spare is None:
            return ceiling if shared_cap else 0
        if self.token_s is None:
            return min(ceiling, UNMEASURED_TOKENS)
        if self.token_s <= 0:  # prompt tokens cost nothing measurable (a simulated clock)
            return ceiling
        return min(ceiling, max(MIN_PREFILL_TOKENS, int(spare / self.token_s)))

    def _spare_seconds(self, contended: bool) -> float | None:
        """What a step may spend on prompt tokens beyond its decodes (None: no limit): while
        contended, (STEP_RATIO - 1) decode-only steps; else what ``prefill_step_seconds`` leaves,
        but never less (a batch of decodes longer than the target still lets prompts in)."""
        base = self.base_s
        if contended and base is not None:
            return (STEP_RATIO - 1) * base
        step_s = self.config.prefill_step_seconds
        if step_s <= 0:
            return None
        return step_s if base is None else max(step_s - base, (STEP_RATIO - 1) * base)

    def step_done(self, plan: Plan, now: float) -> None:
        if self._started is not None:
            scheduled = plan.scheduled
            prefill = sum(
                e.num_tokens for e in scheduled if e.num_tokens > 1 and not e.draft_token_ids
            )
            self.observe(now - self._started, prefill)
            self._started = None

    def observe(self, seconds: float, prefill_tokens: int) -> None:
        """A step with ``prefill_tokens`` prompt tokens took ``seconds``."""
        if prefill_tokens == 0:
            last = self.base_s
            self.base_s = seconds if last is None else last + BASE_EMA * (seconds - last)
        else:
            beyond = max(seconds - (self.base_s or 0.0), 0.1 * seconds)
            cost = beyond / prefill_tokens
            last = self.token_s
            self.token_s = cost if last is None else last + TOKEN_EMA * (cost - last)
