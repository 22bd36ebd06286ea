"""Compile-check every kernel library for every x86 target, whatever this CPU runs:

    python -m pagekv.kernels.check

A full compile per target with the build's flags (``-O3 -Wall -Wextra``) and ``-Werror``,
output discarded, so a branch for an instruction set this machine lacks cannot rot unbuilt,
and warnings (the optimizer's too) stay at zero. Exits non-zero on any failure.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from pagekv.kernels import build, isa


def main() -> int:
    jobs = [(name, t.name) for name in build.library_names() for t in isa.TARGETS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda job: (job, build.compile_check(*job)), jobs))
    failed = 0
    for (name, target), done in results:
        ok = done.returncode == 0 and not done.stderr.strip()
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}.cpp [{target}]")
        if not ok:
            print(done.stderr, file=sys.stderr)
    print(f"{len(jobs) - failed}/{len(jobs)} compile checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
