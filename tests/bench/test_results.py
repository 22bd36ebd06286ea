"""``benchmarks/RESULTS.md`` is what ``benchmarks/results.py`` writes from the records, and a
record a benchmark saves is read back and rendered as its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


@pytest.fixture
def results_modules(monkeypatch: pytest.MonkeyPatch) -> tuple[object, object]:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import record
    import results

    return record, results


def test_results_md_is_generated_from_the_records() -> None:
    check = [sys.executable, str(BENCHMARKS / "results.py"), "--check"]
    done = subprocess.run(check, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_saved_record_is_rendered_as_its_table(
    results_modules: tuple[object, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record, results = results_modules
    monkeypatch.setattr(record, "RESULTS_DIR", tmp_path)
    path = record.save(  # type: ignore[attr-defined]
        "core", "Core memory manager", ["op", "ns"], [["allocate", 41.5], ["free", 38]], "ns/op."
    )
    loaded = record.load(path)  # type: ignore[attr-defined]
    assert loaded.rows == [["allocate", 41.5], ["free", 38]] and not loaded.source
    text = results.render(results.load_all(tmp_path))  # type: ignore[attr-defined]
    assert "| op | ns |" in text and "| allocate | 41.5 |" in text and "ns/op." in text
    with pytest.raises(ValueError, match="row"):
        record.save("core", "bad", ["op", "ns"], [["allocate"]])  # type: ignore[attr-defined]
