"""One benchmark result as a JSON record: ``benchmarks/results/<name>.json``.

Each benchmark that ``RESULTS.md`` reports takes ``--record [NAME]`` (``add_argument``) and
hands its summary table to ``save``; ``results.py`` renders every record into ``RESULTS.md``.
A record says what was measured (title, columns, rows, a short note), how (the command line,
with the environment variables that change what runs), where (the CPU, its logical CPUs,
pagekv's kernel target), on what code (the commit, ``+dirty`` with uncommitted changes outside
the records) and when (the UTC date). ``save`` never writes ``source``: that field marks the
records transcribed by hand from elsewhere, which a real run replaces.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")
# Variables that change what a benchmark runs; shown before the command when set.
ENV_PREFIXES = (
    "PAGEKV_",
    "OMP_NUM_THREADS",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "VLLM_CPU_",
)

Cell = str | int | float | None


@dataclass(frozen=True)
class Machine:
    cpu: str  # the model name /proc/cpuinfo gives
    cores: int  # logical CPUs (os.cpu_count())
    kernel_target: str | None  # pagekv.kernels.isa.selected(), "none"; None: not recorded


@dataclass(frozen=True)
class Record:
    name: str
    title: str  # what is measured
    command: str  # relative to the repository root
    machine: Machine
    commit: str
    date: str  # YYYY-MM-DD, UTC
    columns: list[str]
    rows: list[list[Cell]]
    note: str = ""  # what a reader needs: the baseline, the units
    source: str = ""  # only in records transcribed by hand


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--record [NAME]``: ``args.record`` is None without it, "" for the default name."""
    parser.add_argument(
        "--record",
        nargs="?",
        const="",
        default=None,
        metavar="NAME",
        help="save the summary table as benchmarks/results/NAME.json (default NAME: this "
        "benchmark's), then `python benchmarks/results.py` regenerates RESULTS.md",
    )


def save(name: str, title: str, columns: list[str], rows: list[list[Cell]], note: str = "") -> Path:
    """Write this run's record as ``RESULTS_DIR/name.json`` and return its path."""
    record = Record(
        name=name,
        title=title,
        command=command_line(),
        machine=this_machine(),
        commit=commit(),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        columns=list(columns),
        rows=[list(row) for row in rows],
        note=note,
    )
    validate(record)
    path = RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(record), encoding="utf-8")
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    print(f"recorded {shown}", file=sys.stderr)
    return path


def to_json(record: Record) -> str:
    """Indented JSON with the columns on one line and each row on its own."""
    data = asdict(record)
    if not record.source:
        del data["source"]

    def value(key: str, item: object) -> str:
        if key == "rows" and record.rows:
            rows = (json.dumps(row, ensure_ascii=False) for row in record.rows)
            return "[\n    " + ",\n    ".join(rows) + "\n  ]"
        indent = None if key == "columns" else 2
        return json.dumps(item, indent=indent, ensure_ascii=False).replace("\n", "\n  ")

    fields = (f"  {json.dumps(key)}: {value(key, item)}" for key, item in data.items())
    return "{\n" + ",\n".join(fields) + "\n}\n"


def load(path: Path) -> Record:
    """A record from its JSON file; ValueError if a field is missing or of the wrong type."""
    data = json.loads(path.read_text(encoding="utf-8"))
    try:
        record = Record(**{**data, "machine": Machine(**data["machine"])})
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a benchmark record ({exc})") from exc
    validate(record)
    if path.stem != record.name:
        raise ValueError(f"{path}: holds the record {record.name!r}")
    return record


def validate(record: Record) -> None:
    if not NAME.fullmatch(record.name):
        raise ValueError(f"record name {record.name!r}: lowercase letters, digits, - _ . only")
    texts = (record.title, record.command, record.commit, record.date, record.note, record.source)
    if not all(isinstance(t, str) for t in (*texts, *record.columns)):
        raise ValueError(f"{record.name}: the texts and column names must be strings")
    machine = record.machine
    if not (
        isinstance(machine.cpu, str)
        and isinstance(machine.cores, int)
        and isinstance(machine.kernel_target, str | None)
    ):
        raise ValueError(f"{record.name}: machine: cpu a string, cores an int, kernel_target a str")
    for row in record.rows:
        if len(row) != len(record.columns):
            raise ValueError(f"{record.name}: row {row} has not {len(record.columns)} cells")
        for cell in row:
            if isinstance(cell, bool) or not isinstance(cell, str | int | float | None):
                raise ValueError(f"{record.name}: cell {cell!r} is not a string or number")
            if isinstance(cell, float) and not math.isfinite(cell):
                raise ValueError(f"{record.name}: cell {cell!r} is not finite")


def command_line() -> str:
    """``sys.argv`` as a shell line run from the repository root, after the variables set."""
    script = Path(sys.argv[0]).resolve()
    words = list(sys.argv)
    if script.is_file():
        words[0] = str(script.relative_to(REPO)) if script.is_relative_to(REPO) else str(script)
        words.insert(0, "python")
    env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)]
    return shlex.join([*env, *words])


def this_machine() -> Machine:
    sys.path.insert(0, str(REPO))
    from pagekv.kernels import isa

    return Machine(isa.cpu_name(), os.cpu_count() or 1, isa.selected() or isa.NONE)


def commit() -> str:
    """``git rev-parse --short HEAD``, with ``+dirty`` if tracked files outside the records
    differ from it (a benchmark run after another has recorded is still clean)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(done.stderr.strip())
        return done.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        outside_records = [".", ":!benchmarks/results", ":!benchmarks/RESULTS.md"]
        changes = git("status", "--porcelain", "--untracked-files=no", "--", *outside_records)
    except OSError:
        return "unknown"
    return f"{head}+dirty" if changes else head
