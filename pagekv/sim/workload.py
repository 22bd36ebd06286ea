"""Synthetic workloads for the simulator: length distributions, sharing patterns, arrivals.

Owns the workload definitions (``LengthDist``, ``WorkloadSpec``, the named presets) and the
request records they produce (``SimRequest``). Pure data and numpy; must not import torch, the
engine or the server.

Token ids are handed out by a counter (``TokenIds``), so every fresh token is distinct from
every other: two requests share K/V blocks exactly where the workload gives them the same ids
(a system prompt, a chat's own history, the branches of one ``n > 1`` request) and nowhere
else. Outputs are decided up front too, so a chat's next turn can contain, id for id, the
previous turn's answer, and the simulator "samples" by reading the next planned id.

    synthetic      independent prompts
    shared_prefix  ``num_prefixes`` system prompts, each request picks one, then its own text
    multi_turn     chats of ``num_turns`` turns: turn k+1's prompt = turn k's prompt + answer +
                   a new user message; it arrives ``think_time_s`` after turn k finishes
    parallel       every request samples ``n`` branches that share the prompt (fork)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from pagekv.errors import InvalidRequestError


class DistKind(Enum):
    FIXED = "fixed"
    UNIFORM = "uniform"
    LOGNORMAL = "lognormal"


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts; samples are integers in ``[1, max_len]``.

    fixed: always ``mean``. uniform: integers in ``[low, high]``. lognormal: fitted to ``mean``
    and ``std`` (moments of the lognormal itself), then rounded and clipped to ``[1, max_len]``,
    which moves the sample mean a little when the tail is cut.
    """

    kind: DistKind
    mean: float = 0.0
    std: float = 0.0
    low: int = 0
    high: int = 0
    max_len: int = 1 << 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _dist_kind(self.kind))
        if self.kind is DistKind.UNIFORM:
            if not 1 <= self.low <= self.high:
                raise InvalidRequestError(
                    f"uniform lengths need 1 <= low <= high, got low={self.low}, high={self.high}",
                    "length",
                )
        elif not (math.isfinite(self.mean) and self.mean >= 1):
            raise InvalidRequestError(
                f"{self.kind.value} lengths need a mean >= 1 token, got {self.mean}", "length"
            )
        if not (math.isfinite(self.std) and self.std >= 0):
            raise InvalidRequestError(f"length std must be >= 0, got {self.std}", "length")
        if self.max_len < 1:
            raise InvalidRequestError(f"max_len must be >= 1, got {self.max_len}", "length")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``fixed:128``, ``uniform:32,512`` or ``lognormal:161,200`` (mean, std)."""
        kind, _, rest = text.partition(":")
        try:
            values = [float(v) for v in rest.split(",")] if rest else []
        except ValueError:
            values = []
        expected = {"fixed": 1, "uniform": 2, "lognormal": 2}.get(kind)
        if expected is None or len(values) != expected:
            raise InvalidRequestError(
                f"cannot read length distribution {text!r}: expected fixed:N, uniform:LOW,HIGH "
                "or lognormal:MEAN,STD",
                "length",
            )
        if kind == "uniform":
            return cls(DistKind.UNIFORM, low=int(values[0]), high=int(values[1]))
        if kind == "fixed":
            return cls(DistKind.FIXED, mean=values[0])
        return cls(DistKind.LOGNORMAL, mean=values[0], std=values[1])

    def sample(self, rng: np.random.Generator, num: int) -> list[int]:
        if self.kind is DistKind.FIXED:
            raw = np.full(num, round(self.mean))
        elif self.kind is DistKind.UNIFORM:
            raw = rng.integers(self.low, self.high, size=num, endpoint=True)
        else:
            # Lognormal with E[X] = mean, Std[X] = std: sigma^2 = ln(1 + (std/mean)^2).
            sigma2 = math.log1p((self.std / self.mean) ** 2)
            mu = math.log(self.mean) - sigma2 / 2
            raw = np.rint(rng.lognormal(mu, math.sqrt(sigma2), size=num))
        return [int(x) for x in np.clip(raw, 1, self.max_len)]


def _dist_kind(value: object) -> DistKind:
    try:
        return value if isinstance(value, DistKind) else DistKind(value)
    except ValueError:
        kinds = [k.value for k in DistKind]
        raise InvalidRequestError(
            f"length distribution must be one of {kinds}, got {value!r}", "length"
        ) from None


class WorkloadKind(Enum):
    SYNTHETIC = "synthetic"
    SHARED_PREFIX = "shared_prefix"
    MULTI_TURN = "multi_turn"
    PARALLEL = "parallel"


@dataclass(frozen=True)
class SimRequest:
    """One user request as the simulator replays it.

    ``outputs`` holds the planned output ids of each branch (``n = len(outputs)``). A request
    with ``follows`` set arrives ``arrival_s`` seconds after that request finishes (a chat's
    next turn); otherwise ``arrival_s`` is absolute.
    """

    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    outputs: tuple[tuple[int, ...], ...]
    follows: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def expected_steps(
    requests: Sequence[SimRequest], max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """A lower bound on the steps a run takes (to space out its usage samples)."""
    if not requests:
        return 0
    num_out = sum(r.num_output_tokens for r in requests)
    num_in = sum(len(r.prompt_token_ids) for r in requests)
    longest = max(len(o) for r in requests for o in r.outputs)
    return max(num_out // max_num_seqs, (num_in + num_out) // max_num_batched_tokens, longest)


class TokenIds:
    """Hands out never-repeating token ids, so unrelated text can never share a block.

    Owner of the counter; one instance per workload.
    """

    def __init__(self, first: int = 1) -> None:
        self._next = first

    def take(self, num: int) -> list[int]:
        start = self._next
        self._next += num
        return list(range(start, start + num))


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that defines a workload; ``build_workload`` turns it into requests."""

    kind: WorkloadKind = WorkloadKind.SYNTHETIC
    num_requests: int = 1000
    prompt: LengthDist = field(default_factory=lambda: LengthDist(DistKind.FIXED, mean=128))
    output: LengthDist = field(default_factory=lambda: LengthDist(DistKind.FIXED, mean=128))
    rate: float | None = None  # Poisson arrivals per second; None: all at t = 0
    num_prefixes: int = 4  # shared_prefix: distinct system prompts
    prefix: LengthDist = field(default_factory=lambda: LengthDist(DistKind.FIXED, mean=256))
    num_turns: int = 4  # multi_turn: turns per chat (num_requests counts turns)
    think_time_s: float = 5.0  # multi_turn: pause between an answer and the next turn
    n: int = 1  # parallel: branches per request
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _workload_kind(self.kind))
        checks = (
            (self.num_requests >= 1, "num_requests must be >= 1"),
            (self.rate is None or (math.isfinite(self.rate) and self.rate > 0), "rate must be > 0"),
            (self.num_prefixes >= 1, "num_prefixes must be >= 1"),
            (self.num_turns >= 1, "num_turns must be >= 1"),
            (math.isfinite(self.think_time_s) and self.think_time_s >= 0, "think_time_s >= 0"),
            (self.n >= 1, "n must be >= 1"),
        )
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(f"workload: {message}", "workload")


def _workload_kind(value: object) -> WorkloadKind:
    try:
        return value if isinstance(value, WorkloadKind) else WorkloadKind(value)
    except ValueError:
        kinds = [k.value for k in WorkloadKind]
        raise InvalidRequestError(f"workload kind must be one of {kinds}", "workload") from None


def _lognormal(mean: float, std: float, max_len: int = 1024) -> LengthDist:
    return LengthDist(DistKind.LOGNORMAL, mean=mean, std=std, max_len=max_len)


# Means from the PagedAttention paper's datasets (ShareGPT: 161 prompt / 338 output tokens;
# Alpaca: 19 / 58). The spreads are our assumption (long-tailed, std about the mean), not the
# paper's. Prompt and output are each capped at 1024 so that together they fit the 2048-token
# context of the paper's OPT models (the cap trims the ShareGPT output mean by about 3%).
PRESETS: dict[str, WorkloadSpec] = {
    "synthetic": WorkloadSpec(),  # fixed 128 + 128; set the lengths with --prompt-len etc.
    "sharegpt": WorkloadSpec(prompt=_lognormal(161, 160), output=_lognormal(338, 300)),
    "alpaca": WorkloadSpec(prompt=_lognormal(19, 12), output=_lognormal(58, 50)),
    "random": WorkloadSpec(
        num_requests=64,
        prompt=LengthDist(DistKind.UNIFORM, low=32, high=512),
        output=LengthDist(DistKind.UNIFORM, low=16, high=256),
    ),
    "prefix": WorkloadSpec(
        kind=WorkloadKind.SHARED_PREFIX,
        prompt=_lognormal(24, 16),
        output=_lognormal(32, 24),
        prefix=LengthDist(DistKind.UNIFORM, low=24, high=80),
    ),
    "chat": WorkloadSpec(
        kind=WorkloadKind.MULTI_TURN, prompt=_lognormal(48, 40), output=_lognormal(120, 100)
    ),
    "parallel": WorkloadSpec(
        kind=WorkloadKind.PARALLEL, n=4, prompt=_lognormal(161, 160), output=_lognormal(100, 80)
    ),
}


def preset(name: str, **changes: object) -> WorkloadSpec:
    """A named workload, with fields overridden (``num_requests=...``, ``rate=...``)."""
    if name not in PRESETS:
        raise InvalidRequestError(
            f"unknown workload {name!r}; choose one of {sorted(PRESETS)}", "workload"
        )
    return replace(PRESETS[name], **changes)  # type: ignore[arg-type]


def build_workload(spec: WorkloadSpec) -> list[SimRequest]:
    """The requests of ``spec``, deterministic in ``spec.seed``."""
    rng = np.random.default_rng(spec.seed)
    ids = TokenIds()
    builders = {
        WorkloadKind.SYNTHETIC: _independent,
        WorkloadKind.PARALLEL: _independent,
        WorkloadKind.SHARED_PREFIX: _shared_prefix,
        WorkloadKind.MULTI_TURN: _multi_turn,
    }
    return list(builders[spec.kind](spec, rng, ids))


def arrival_times(rate: float | None, num: int, rng: np.random.Generator) -> list[float]:
    """All at t = 0, or a Poisson process of ``rate`` per second starting at t = 0."""
    if rate is None:
        return [0.0] * num
    gaps = rng.exponential(1.0 / rate, size=num)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


def from_prompts(
    prompts: list[list[int]], output_lens: list[int], arrivals: list[float] | None = None
) -> list[SimRequest]:
    """Requests with given prompt ids (a benchmark's), outputs drawn above every prompt id."""
    if len(prompts) != len(output_lens):
        raise InvalidRequestError("one output length per prompt", "output_lens")
    first = 1 + max((max(p) for p in prompts if p), default=0)
    ids = TokenIds(first)
    times = arrivals if arrivals is not None else [0.0] * len(prompts)
    return [
        SimRequest(f"req-{i}", times[i], list(p), _outputs(ids, [n]))
        for i, (p, n) in enumerate(zip(prompts, output_lens, strict=True))
    ]


def _outputs(ids: TokenIds, lens: list[int]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(ids.take(n)) for n in lens)


def _independent(
    spec: WorkloadSpec, rng: np.random.Generator, ids: TokenIds
) -> Iterator[SimRequest]:
    num = spec.num_requests
    prompts = spec.prompt.sample(rng, num)
    outputs = spec.output.sample(rng, num * spec.n)
    arrivals = arrival_times(spec.rate, num, rng)
    for i in range(num):
        lens = outputs[i * spec.n : (i + 1) * spec.n]
        yield SimRequest(f"req-{i}", arrivals[i], ids.take(prompts[i]), _outputs(ids, lens))


def _shared_prefix(
    spec: WorkloadSpec, rng: np.random.Generator, ids: TokenIds
) -> Iterator[SimRequest]:
    prefixes = [ids.take(n) for n in spec.prefix.sample(rng, spec.num_prefixes)]
    num = spec.num_requests
    choice = rng.integers(0, spec.num_prefixes, size=num)
    suffixes = spec.prompt.sample(rng, num)
    outputs = spec.output.sample(rng, num)
    arrivals = arrival_times(spec.rate, num, rng)
    for i in range(num):
        prompt = prefixes[int(choice[i])] + ids.take(suffixes[i])
        yield SimRequest(f"req-{i}", arrivals[i], prompt, _outputs(ids, [outputs[i]]))


def _multi_turn(
    spec: WorkloadSpec, rng: np.random.Generator, ids: TokenIds
) -> Iterator[SimRequest]:
    num_chats = -(-spec.num_requests // spec.num_turns)
    starts = arrival_times(spec.rate, num_chats, rng)
    made = 0
    for chat in range(num_chats):
        history: list[int] = []
        previous: str | None = None
        for turn in range(spec.num_turns):
            if made == spec.num_requests:
                return
            user = ids.take(spec.prompt.sample(rng, 1)[0])
            answer = tuple(ids.take(spec.output.sample(rng, 1)[0]))
            history = history + user
            rid = f"chat-{chat}-turn-{turn}"
            arrival = starts[chat] if previous is None else spec.think_time_s
            yield SimRequest(rid, arrival, history, (answer,), follows=previous)
            history = history + list(answer)
            previous = rid
            made += 1
