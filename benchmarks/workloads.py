"""The standard workloads (``random``, ``prefix``) for the scripts in this folder.

The definitions live in ``pagekv.bench.workloads`` so that the installed ``pagekv bench``
command and these scripts share one implementation; this module only re-exports them.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagekv

from pagekv.bench.workloads import (
    BenchRequest,
    Workload,
    load_workload,
    prefix_workload,
    random_workload,
)

__all__ = ["BenchRequest", "Workload", "load_workload", "prefix_workload", "random_workload"]
