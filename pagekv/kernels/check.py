"""Compile-check every kernel library for every x86 target, whatever this CPU runs, and for
64-bit ARM where Debian's cross compiler is installed:

    python -m pagekv.kernels.check

A full compile per target with the build's flags (``-O3 -Wall -Wextra``) and ``-Werror``,
output discarded, so a branch for an instruction set this machine lacks cannot rot unbuilt,
and warnings (the optimizer's too) stay at zero. Exits non-zero on any failure, and where
``$PAGEKV_REQUIRE_SYSTEM_PACKAGES=1`` (CI) also without the cross compiler.
"""

from __future__ import annotations

import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

from pagekv.kernels import build, isa

AARCH64_PACKAGE = "g++-aarch64-linux-gnu"


def main() -> int:
    # (library, target, compiler: None for the build's, label)
    jobs: list[tuple[str, str, str | None, str]] = [
        (name, t.name, None, t.name) for name in build.library_names() for t in isa.TARGETS
    ]
    cross = shutil.which(build.AARCH64_COMPILER)
    if cross is not None:
        jobs += [(name, "generic", cross, "generic, aarch64") for name in build.library_names()]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda job: (job, build.compile_check(*job[:3])), jobs))
    failed = 0
    for (name, _, _, label), done in results:
        ok = done.returncode == 0 and not done.stderr.strip()
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}.cpp [{label}]")
        if not ok:
            print(done.stderr, file=sys.stderr)
    print(f"{len(jobs) - failed}/{len(jobs)} compile checks passed")
    if cross is None:
        required = os.environ.get("PAGEKV_REQUIRE_SYSTEM_PACKAGES") == "1"
        print(
            f"{'FAIL' if required else 'skip'} aarch64: {build.AARCH64_COMPILER} not installed "
            f"(apt-get install {AARCH64_PACKAGE})"
        )
        failed += required
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
