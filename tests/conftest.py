"""The suite's plugins, its hypothesis profiles (``PAGEKV_HYPOTHESIS_PROFILE=ci``, the default,
``long`` or ``dev``) and its skips, summarized one line per reason at the end of a run."""

import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings

# Kernel targets, session fixtures with the real default model and the transformers reference,
# and the Debian packages some tests need (a skip when absent, listed at the end).
pytest_plugins = ["tests.kernel_targets", "tests.models_fixtures", "tests.system_packages"]

settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long", settings.get_profile("ci"), max_examples=2000, stateful_step_count=200
)
settings.register_profile("dev", settings.get_profile("ci"), max_examples=30)
settings.load_profile(os.environ.get("PAGEKV_HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Skips by reason, most frequent first: a CPU without AMX skips hundreds of tests for one
    reason, which is one line here (``-rs`` still lists them test by test)."""
    reasons: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section("skipped, by reason", sep="-")
        for reason, count in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
            terminalreporter.line(f"{count:5d}  {reason}")
