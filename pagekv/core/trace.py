"""Request traces: the JSON-lines format, its writer (the engine's) and its reader (the sim's).

Owns the format, ``TraceRecorder`` (thread-safe writer) and ``read_trace`` (a reader that names
malformed lines by number). Replaying a trace in the simulator is ``pagekv.sim.trace``'s.
No text is stored, only lengths and the prompt's prefix-block hashes. Imports only core's hash
chain and the errors: no torch, engine, server or simulator.

One request per line::

    {"arrival_s": 12.5, "prompt_len": 161, "output_len": 338, "block_hashes": ["9f0c...", ...]}

``block_hashes`` is the prompt's full-block hash chain at block size 16 (``TRACE_BLOCK_SIZE``,
pagekv.core.prefix_cache, hex): ``prompt_len // 16`` keys, each committing to every token
before it, so two requests share a leading key exactly when they share those 16k tokens.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pagekv.core.prefix_cache import extend_hash_chain
from pagekv.errors import InvalidRequestError

TRACE_BLOCK_SIZE = 16
_HASH_HEX_LEN = 32  # 16-byte blake2b keys


class TraceFormatError(InvalidRequestError):
    """A trace line (or, with ``strict``, the file) cannot be used; the message names lines."""


def block_hashes_hex(prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> list[str]:
    """The prompt's full-block hash chain at block size 16, as hex (what ``record`` takes)."""
    chain: list[bytes] = []
    extend_hash_chain(chain, list(prompt_token_ids), TRACE_BLOCK_SIZE, cache_salt)
    return [h.hex() for h in chain]


@dataclass(frozen=True)
class TraceRecord:
    arrival_s: float
    prompt_len: int
    output_len: int
    block_hashes: tuple[str, ...]
    line: int = 0  # where it was read from (0: not read from a file)


class TraceRecorder:
    """Appends one line per request to ``path`` (created or truncated); safe from any thread.

    Owner of the open file. Each record is flushed at once, so a crash loses at most the line
    being written. ``arrival_s`` may be on any clock in seconds (replay starts at the first).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
        self.num_records = 0

    def record(
        self, arrival_s: float, prompt_len: int, output_len: int, block_hashes_hex: Sequence[str]
    ) -> None:
        """Write one request; raises ``InvalidRequestError`` (writing nothing) on bad values."""
        rec = TraceRecord(float(arrival_s), prompt_len, output_len, tuple(block_hashes_hex))
        problem = _problem(rec)
        if problem is not None:
            raise InvalidRequestError(f"trace record: {problem}", "trace")
        line = json.dumps(
            {
                "arrival_s": rec.arrival_s,
                "prompt_len": rec.prompt_len,
                "output_len": rec.output_len,
                "block_hashes": list(rec.block_hashes),
            },
            separators=(",", ":"),
        )
        with self._lock:
            if self._file is None:
                raise InvalidRequestError(f"trace {self.path} is closed", "trace")
            self._file.write(line + "\n")
            self._file.flush()
            self.num_records += 1

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class TraceProblem:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass(frozen=True)
class Trace:
    records: list[TraceRecord]
    problems: list[TraceProblem]  # lines skipped (empty when read with strict=True)


def read_trace(path: str | Path, strict: bool = False) -> Trace:
    """Parse a trace. Malformed lines are skipped and listed in ``problems`` with their line
    numbers, or, with ``strict``, make the whole file fail (``TraceFormatError`` naming them).
    Blank lines are ignored. A trace with no valid record is always an error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"cannot read trace {path}: {exc}", "trace") from None
    records: list[TraceRecord] = []
    problems: list[TraceProblem] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = _parse(line, number)
        if isinstance(record, TraceProblem):
            problems.append(record)
        else:
            records.append(record)
    if problems and strict:
        shown = "; ".join(str(p) for p in problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise TraceFormatError(f"{path}: {len(problems)} malformed line(s): {shown}{more}", "trace")
    if not records:
        raise TraceFormatError(f"{path}: no valid trace record", "trace")
    return Trace(records, problems)


def _parse(line: str, number: int) -> TraceRecord | TraceProblem:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        return TraceProblem(number, f"not JSON ({exc.msg})")
    if not isinstance(data, dict):
        return TraceProblem(number, "not a JSON object")
    missing = [
        k for k in ("arrival_s", "prompt_len", "output_len", "block_hashes") if k not in data
    ]
    if missing:
        return TraceProblem(number, f"missing {', '.join(missing)}")
    arrival, hashes = data["arrival_s"], data["block_hashes"]
    if isinstance(arrival, bool) or not isinstance(arrival, int | float):
        return TraceProblem(number, f"arrival_s must be a number, got {arrival!r}")
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
        return TraceProblem(number, "block_hashes must be a list of hex strings")
    rec = TraceRecord(float(arrival), data["prompt_len"], data["output_len"], tuple(hashes), number)
    problem = _problem(rec)
    return TraceProblem(number, problem) if problem is not None else rec


def _problem(rec: TraceRecord) -> str | None:
    """What is wrong with a record, or None."""
    if not math.isfinite(rec.arrival_s) or rec.arrival_s < 0:
        return f"arrival_s must be a finite number >= 0, got {rec.arrival_s!r}"
    for name in ("prompt_len", "output_len"):
        value = getattr(rec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} must be an integer >= 1, got {value!r}"
    if len(rec.block_hashes) > rec.prompt_len // TRACE_BLOCK_SIZE:
        return (
            f"{len(rec.block_hashes)} block hashes for a {rec.prompt_len}-token prompt "
            f"(at most {rec.prompt_len // TRACE_BLOCK_SIZE} full blocks of {TRACE_BLOCK_SIZE})"
        )
    for h in rec.block_hashes:
        if len(h) != _HASH_HEX_LEN or any(c not in "0123456789abcdef" for c in h):
            return f"block hash {h[:40]!r} is not {_HASH_HEX_LEN} lowercase hex digits"
    return None
