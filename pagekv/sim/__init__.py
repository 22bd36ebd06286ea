"""pagekv.sim: replay a workload through the real core with a cost model instead of the model.

Answers the block-size question, which cannot be judged apart from the real workload: for
each block size (and for three contiguous-reservation baselines) it reports KV
utilisation, fragmentation, block-table size, prefix-cache hits, preemptions, batch size,
simulated throughput and latency, and recommends one.

    workload.py    synthetic workloads (lengths, shared prefixes, chats, n > 1, arrivals)
    trace.py       JSON-lines traces: recorder (for the server), reader, replay
    cost_model.py  step time from a plan's shape; least-squares fit; default_cost.json
    calibrate.py   measures the real runner to fit a cost model (torch, imported lazily)
    arrivals.py    the requests not yet arrived (by time; a chat's next turn after the last)
    simulator.py   the paged run: pagekv.core's Scheduler + KVCacheManager, unmodified
    baselines.py   contiguous reservation (max length, power of two, oracle)
    metrics.py     what a run measured (SimResult and its accumulators)
    report.py      the study over block sizes, the recommendation, report.md
    plots.py       PNG plots and the block timeline (matplotlib, imported lazily)
    cli.py         ``pagekv sim`` and ``pagekv sim calibrate``

Glossary (see pagekv.core for token, slot, block, block table): a *sequence* is one branch
being generated; a *step* is one simulated engine step, costed by the cost model; *KV
utilisation* is tokens stored over slots reserved, integrated over simulated time.

Layer rule: imports pagekv.core, pagekv.errors and pagekv.sampling_params; never the engine or
the server; torch, pagekv.runner and pagekv.models only inside ``calibrate.calibrate``.
"""

from pagekv.core.trace import TraceRecorder, read_trace
from pagekv.sim.baselines import Reservation, simulate_contiguous
from pagekv.sim.cost_model import CostModel, StepShape
from pagekv.sim.metrics import SimResult
from pagekv.sim.simulator import SimConfig, simulate
from pagekv.sim.trace import replay_trace
from pagekv.sim.workload import LengthDist, SimRequest, WorkloadSpec, build_workload, preset

__all__ = [
    "CostModel",
    "LengthDist",
    "Reservation",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "StepShape",
    "TraceRecorder",
    "WorkloadSpec",
    "build_workload",
    "preset",
    "read_trace",
    "replay_trace",
    "simulate",
    "simulate_contiguous",
]
