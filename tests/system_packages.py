"""The Debian packages some tests need, registered with `pytest_plugins` in conftest.py.

``make test`` installs them where it may (as root, or with passwordless sudo); elsewhere a test
that needs one is skipped with the reason ``"<package> not installed (apt-get install
<package>)"``, and the end of the run lists each missing package with the number of tests it
skipped. A test skips only when the binary or library is absent: once it is there, a server
that does not start or a library that does not load fails the test as before.

PYTEST_DONT_REWRITE: helpers, no asserts.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
from collections import Counter
from collections.abc import Generator

import pytest

REASON = "{package} not installed (apt-get install {package})"
_SKIPPED = re.compile(r"(\S+) not installed \(apt-get install \1\)")


def skip_missing(package: str) -> None:
    """Skip; a failure where ``$PAGEKV_REQUIRE_SYSTEM_PACKAGES=1`` (CI, which installs them)."""
    if os.environ.get("PAGEKV_REQUIRE_SYSTEM_PACKAGES") == "1":
        pytest.fail(REASON.format(package=package) + ", and this run requires it")
    pytest.skip(REASON.format(package=package))


def require_binary(package: str, *names: str) -> str:
    """The path of the first of ``names`` (default: the package's name) on PATH, else a skip."""
    for name in names or (package,):
        path = shutil.which(name)
        if path is not None:
            return path
    skip_missing(package)
    raise AssertionError("unreachable")  # pytest.skip raises


def require_library(package: str, soname: str) -> None:
    """Skip unless the dynamic loader finds ``soname`` (e.g. libibverbs1's libibverbs.so.1)."""
    try:
        ctypes.CDLL(soname)
    except OSError:
        skip_missing(package)


@pytest.fixture(scope="session")
def chromium() -> str:
    """Headless Chromium for the /debug/kv page's pictures."""
    return require_binary("chromium", "chromium", "chromium-browser")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter,
) -> Generator[None, None, None]:
    """After pytest's own summary and the skips by reason: the missing packages, plainly."""
    yield
    missing: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        if isinstance(longrepr, tuple) and (found := _SKIPPED.search(str(longrepr[2]))):
            missing[found.group(1)] += 1
    if not missing:
        return
    terminalreporter.section("missing system packages", sep="=", yellow=True, bold=True)
    for package, count in sorted(missing.items()):
        terminalreporter.line(f"{package}: {count} test{'s' * (count != 1)} skipped")
    names = " ".join(sorted(missing))
    terminalreporter.line(f"install them with `apt-get install {names}` (as root) and rerun")
