"""What a simulation measured: the result record shared by the paged and contiguous runs.

Owns ``SimResult`` and the helpers that accumulate it: ``UsageSeries`` (time-weighted samples of
the KV pool, thinned as a run grows so memory stays bounded), ``Latencies`` (per-sequence
arrival, first token, finish) and ``BlockTimeline`` (the pool's block states over time, for the
picture). No torch, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Block states in a ``BlockTimeline`` column; owners get OWNER_BASE + (owner index % palette).
FREE, EVICTABLE, SHARED, OWNER_BASE = 0, 1, 2, 3


@dataclass(frozen=True)
class Percentiles:
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0

    @classmethod
    def of(cls, values: list[float]) -> Percentiles:
        if not values:
            return cls()
        p50, p90, p99 = np.percentile(np.array(values), [50, 90, 99])
        return cls(float(p50), float(p90), float(p99))


@dataclass
class UsageSeries:
    """Samples (time, weight, slots reserved, tokens stored, table entries) of the KV pool.

    A sample is taken every ``every`` steps and weighs the simulated seconds since the previous
    one; past ``2 * cap`` samples, neighbours merge pairwise and ``every`` doubles, so a run of
    any length keeps between ``cap`` and ``2 * cap`` evenly spaced samples. (A sample of the
    paged pool walks every block-table entry, so a run starts ``every`` near its expected number
    of steps / ``2 * cap`` rather than sampling each step.)
    """

    cap: int = 48
    every: int = 1
    times_s: list[float] = field(default_factory=list)
    weights_s: list[float] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)
    _steps: int = 0
    _pending_s: float = 0.0

    @classmethod
    def for_steps(cls, expected_steps: int) -> UsageSeries:
        series = cls()
        series.every = max(1, expected_steps // (2 * series.cap))
        return series

    def tick(self, dt_s: float) -> bool:
        """Count one step of ``dt_s``; whether a sample is due now."""
        self._steps += 1
        self._pending_s += dt_s
        return self._steps % self.every == 0

    def add(self, time_s: float, slots: int, tokens: int, entries: int) -> None:
        self.times_s.append(time_s)
        self.weights_s.append(self._pending_s)
        self.slots.append(slots)
        self.tokens.append(tokens)
        self.entries.append(entries)
        self._pending_s = 0.0
        if len(self.times_s) > 2 * self.cap:
            self._thin()

    def _thin(self) -> None:
        w = self.weights_s
        self.weights_s = [w[i] + (w[i + 1] if i + 1 < len(w) else 0.0) for i in range(0, len(w), 2)]
        for name in ("times_s", "slots", "tokens", "entries"):
            values = getattr(self, name)
            setattr(self, name, values[1::2] + ([values[-1]] if len(values) % 2 else []))
        self.every *= 2

    def utilisation(self) -> float:
        """Time integral of tokens stored over time integral of slots reserved."""
        slots = float(np.dot(self.weights_s, self.slots)) if self.slots else 0.0
        return float(np.dot(self.weights_s, self.tokens)) / slots if slots > 0 else 0.0

    def mean_entries(self) -> float:
        total = sum(self.weights_s)
        return float(np.dot(self.weights_s, self.entries)) / total if total > 0 else 0.0


@dataclass
class Latencies:
    """Per sequence: arrival, first-token and finish times (simulated seconds)."""

    arrival_s: dict[str, float] = field(default_factory=dict)
    first_s: dict[str, float] = field(default_factory=dict)
    finish_s: dict[str, float] = field(default_factory=dict)
    num_output: dict[str, int] = field(default_factory=dict)

    def ttft(self) -> Percentiles:
        return Percentiles.of([t - self.arrival_s[r] for r, t in self.first_s.items()])

    def tpot(self) -> Percentiles:
        values = [
            (end - self.first_s[r]) / (self.num_output[r] - 1)
            for r, end in self.finish_s.items()
            if self.num_output.get(r, 0) > 1 and r in self.first_s
        ]
        return Percentiles.of(values)


@dataclass
class BlockTimeline:
    """Columns of block states (``FREE``, ``EVICTABLE``, ``SHARED``, owner colours) over time.

    Thinned like ``UsageSeries``: at most ``2 * cap`` columns, evenly spaced in steps.
    """

    num_blocks: int
    cap: int = 300
    every: int = 1
    palette: int = 20
    times_s: list[float] = field(default_factory=list)
    columns: list[np.ndarray] = field(default_factory=list)
    _owners: dict[str, int] = field(default_factory=dict)
    _steps: int = 0

    def tick(self) -> bool:
        self._steps += 1
        return self._steps % self.every == 0

    def add(
        self,
        time_s: float,
        evictable: list[int],
        owners: dict[int, list[str]],
        family: dict[str, str],
    ) -> None:
        """One column: ``owners`` maps each used block to its requests; ``family`` maps a
        branch to its group, so all branches of one request share a colour."""
        column = np.full(self.num_blocks, FREE, dtype=np.int16)
        column[evictable] = EVICTABLE
        for block, rids in owners.items():
            groups = {family.get(r, r) for r in rids}
            if len(groups) > 1 or len(rids) > 1:
                column[block] = SHARED
            else:
                index = self._owners.setdefault(groups.pop(), len(self._owners))
                column[block] = OWNER_BASE + index % self.palette
        self.times_s.append(time_s)
        self.columns.append(column)
        if len(self.columns) > 2 * self.cap:
            self.columns = self.columns[1::2]
            self.times_s = self.times_s[1::2]
            self.every *= 2

    def image(self) -> np.ndarray:
        """int16 [num_blocks, num_columns]."""
        if not self.columns:
            return np.zeros((self.num_blocks, 0), dtype=np.int16)
        return np.stack(self.columns, axis=1)


@dataclass(frozen=True)
class SimResult:
    """One simulated run (a block size of the paged system, or a contiguous baseline)."""

    label: str
    block_size: int | None  # None for a contiguous baseline
    num_requests: int  # sequences that finished (branches of n > 1 count one each)
    num_rejected: int
    num_steps: int
    sim_time_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    kv_utilisation: float
    internal_fragmentation: float
    mean_table_entries: float
    prefix_hit_rate: float
    num_preemptions: int
    max_batch: int
    ttft_s: Percentiles
    tpot_s: Percentiles
    usage: UsageSeries
    blocks: BlockTimeline | None = None

    @property
    def throughput(self) -> float:
        """Generated tokens per simulated second."""
        return self.num_output_tokens / self.sim_time_s if self.sim_time_s > 0 else 0.0
