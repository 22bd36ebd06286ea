"""The step-time model the simulator charges instead of running the model, and its fit.

Owns ``StepShape`` (what one step asks of the hardware, read off a plan) and ``CostModel``
(seconds per unit of each feature), its JSON form and its least-squares fit. No torch: the
measurements come from ``calibrate.py``. The default, measured on the project's machine, ships
as ``default_cost.json`` next to this file.

    step_s = fixed_s
           + per_token_s          x batched tokens       every new token through the layers
           + per_context_token_s  x context tokens read  sum of the sequences' lengths
           + per_padded_context_s x seqs x max_seq_len   the reference kernel gathers every
                                                         sequence padded to the longest
           + per_padded_cell_s    x seqs x max_query_len x max_seq_len
                                                         ... and scores every padded query row
           + per_seq_s            x seqs                 per-sequence work: logits, sampling
           + per_table_entry_s    x block-table entries  the indirection: tables built and read
                                                         block by block (tiny blocks pay here)
           + per_block_transfer_s x blocks swapped or copied (taken from the swap benchmark)

The two padded terms exist because pagekv's reference attention pads every sequence of a step
to the longest query and context; a kernel without padding fits them near zero.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from pagekv.core.plan import Plan
from pagekv.errors import InvalidRequestError

FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class StepShape:
    """The features of one step (see the module docstring)."""

    num_seqs: int = 0
    num_batched_tokens: int = 0
    num_context_tokens: int = 0
    num_padded_context_tokens: int = 0
    num_padded_cells: int = 0
    num_table_entries: int = 0
    num_transfer_blocks: int = 0

    @classmethod
    def of_plan(cls, plan: Plan) -> StepShape:
        num_tokens = context = max_query = max_seq = entries = 0
        for entry in plan.scheduled:
            q = entry.num_tokens
            end = entry.start_position + q
            num_tokens += q
            context += end
            entries += len(entry.block_table)
            if q > max_query:
                max_query = q
            if end > max_seq:
                max_seq = end
        t = plan.transfers
        num_seqs = len(plan.scheduled)
        return cls(
            num_seqs=num_seqs,
            num_batched_tokens=num_tokens,
            num_context_tokens=context,
            num_padded_context_tokens=num_seqs * max_seq,
            num_padded_cells=num_seqs * max_query * max_seq,
            num_table_entries=entries,
            num_transfer_blocks=len(t.swap_out) + len(t.swap_in) + len(t.copies),
        )

    def features(self) -> list[float]:
        """In ``CostModel.coefficients()`` order, after the constant 1."""
        return [
            1.0,
            self.num_batched_tokens,
            self.num_context_tokens,
            self.num_padded_context_tokens,
            self.num_padded_cells,
            self.num_seqs,
            self.num_table_entries,
            self.num_transfer_blocks,
        ]


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of each ``StepShape`` feature; ``meta`` says where they came from."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0
    per_context_token_s: float = 0.0
    per_padded_context_s: float = 0.0
    per_padded_cell_s: float = 0.0
    per_seq_s: float = 0.0
    per_table_entry_s: float = 0.0
    per_block_transfer_s: float = 2.86e-4  # bench_swap_cost.py, 16-token blocks, CPU
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name, value in zip(self.names(), self.coefficients(), strict=True):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequestError(f"cost model: {name} must be a number", name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidRequestError(f"cost model: {name} must be >= 0, got {value}", name)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "meta"]

    def coefficients(self) -> list[float]:
        return [getattr(self, n) for n in self.names()]

    def step_s(self, shape: StepShape) -> float:
        return (
            self.fixed_s
            + self.per_token_s * shape.num_batched_tokens
            + self.per_context_token_s * shape.num_context_tokens
            + self.per_padded_context_s * shape.num_padded_context_tokens
            + self.per_padded_cell_s * shape.num_padded_cells
            + self.per_seq_s * shape.num_seqs
            + self.per_table_entry_s * shape.num_table_entries
            + self.per_block_transfer_s * shape.num_transfer_blocks
        )

    # ---- JSON -----------------------------------------------------------------------------------

    def to_json(self) -> str:
        data = asdict(self)
        meta = data.pop("meta")
        return json.dumps({"version": FORMAT_VERSION, "coefficients": data, "meta": meta}, indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "cost model") -> CostModel:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{source}: not JSON: {exc}", "cost") from None
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise InvalidRequestError(f"{source}: expected version {FORMAT_VERSION}", "cost")
        coefficients = data.get("coefficients")
        if not isinstance(coefficients, dict) or set(coefficients) - set(cls.names()):
            raise InvalidRequestError(
                f"{source}: 'coefficients' must map some of {cls.names()} to numbers", "cost"
            )
        return cls(**coefficients, meta=dict(data.get("meta") or {}))

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidRequestError(f"cannot read cost model {path}: {exc}", "cost") from None
        return cls.from_json(text, str(path))

    @classmethod
    def default(cls) -> CostModel:
        """The model measured on the project's machine (``pagekv sim calibrate`` remakes it)."""
        text = resources.files("pagekv.sim").joinpath("default_cost.json").read_text("utf-8")
        return cls.from_json(text, "default_cost.json")


def fit(
    shapes: Sequence[StepShape], seconds: Sequence[float], meta: dict[str, Any] | None = None
) -> CostModel:
    """Weighted least squares, every coefficient >= 0 (a negative cost means nothing).

    A step's time is a sum of many kernels' times, so its variance grows with its length:
    each sample is weighted by 1 / sqrt(seconds), between plain least squares (where a few
    10 s prefills would decide everything) and relative error (where they would count no more
    than a 0.1 s decode, though a run spends much of its time in them).
    ``per_block_transfer_s`` keeps its default (calibration plans move no blocks). The samples
    are kept in ``meta`` for refits.
    """
    if len(shapes) != len(seconds) or len(shapes) < 3:
        raise InvalidRequestError("fit needs at least 3 (shape, seconds) pairs", "shapes")
    x = np.array([s.features()[:-1] for s in shapes], dtype=np.float64)
    y = np.array(seconds, dtype=np.float64)
    weight = 1.0 / np.sqrt(np.maximum(y, 1e-9))
    coef = nonnegative_least_squares(x * weight[:, None], y * weight)
    predicted = x @ coef
    rel = np.abs(predicted - y) / np.maximum(y, 1e-12)
    info = {
        "num_samples": len(y),
        "mean_abs_rel_error": float(rel.mean()),
        "max_abs_rel_error": float(rel.max()),
        "total_rel_error": float((predicted.sum() - y.sum()) / y.sum()),
        **(meta or {}),
        "sample_columns": [*CostModel.names()[1:-1], "seconds"],
        "samples": [[*s.features()[1:-1], t] for s, t in zip(shapes, seconds, strict=True)],
    }
    values = dict(zip(CostModel.names()[:-1], (float(c) for c in coef), strict=True))
    return CostModel(**values, meta=info)


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray, max_iter: int = 100) -> np.ndarray:
    """argmin ||x c - y|| subject to c >= 0 (Lawson-Hanson active set, columns rescaled)."""
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    a = x / scale
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    c = np.zeros(n)
    for _ in range(max_iter):
        gradient = a.T @ (y - a @ c)
        candidates = ~passive & (gradient > 1e-12 * max(1.0, float(np.abs(gradient).max())))
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, gradient, -np.inf)))] = True
        while True:
            trial = np.zeros(n)
            trial[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (trial[passive] > 0).all():
                c = trial
                break
            # Step from c towards trial until the first passive coefficient hits zero.
            blocked = passive & (trial <= 0)
            alpha = np.min(c[blocked] / np.maximum(c[blocked] - trial[blocked], 1e-300))
            c = c + alpha * (trial - c)
            passive &= c > 1e-15
            c[~passive] = 0.0
    result: np.ndarray = c / scale
    return result
