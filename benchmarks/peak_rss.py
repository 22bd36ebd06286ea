"""Peak memory of a whole process tree (an engine and every worker it spawns), by sampling.

    python benchmarks/peak_rss.py [--record] -- pagekv bench --workload random --num-threads 1

``ru_maxrss`` sees one process only, and vLLM runs its engine core in a child process, so
this samples the tree with psutil every ``--interval`` seconds and reports the peak of
- the sum of RSS over the tree (counts pages shared between the processes once per process),
- the sum of PSS (shared pages split between their sharers: the tree's real footprint),
- the largest single process's RSS.
Sampling can miss a spike shorter than the interval; PSS reads /proc/PID/smaps, so the PSS
samples are taken every ``pss_every`` RSS samples (a PSS sample of a large process takes
noticeable CPU). A caller that stops the tree (SIGSTOP) between timed passes pauses the sampler
meanwhile (a stopped tree's memory cannot change, and the samples would take CPU from whatever
runs beside it) and may take the PSS samples then, with ``pss_every=0`` and ``sample``, so that
they cost the tree's own passes nothing either.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record


class TreeSampler:
    """Samples the memory of ``pid`` and its descendants on a thread until ``stop()``."""

    def __init__(self, pid: int, interval: float = 0.1, pss_every: int = 5) -> None:
        self.root = psutil.Process(pid)
        self.interval = interval
        self.pss_every = pss_every
        self.peak_rss_sum = 0
        self.peak_pss_sum = 0
        self.peak_rss_single = 0
        self.samples = 0
        self._stop = threading.Event()
        self._active = threading.Event()  # cleared while paused
        self._active.set()
        self._sampling = threading.Lock()  # held during one sample
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def pause(self) -> None:
        """No samples until ``resume``; returns once a sample in flight has ended."""
        self._active.clear()
        with self._sampling:
            pass

    def resume(self) -> None:
        self._active.set()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.result()

    def result(self) -> dict[str, int]:
        return {
            "peak_rss_sum_bytes": self.peak_rss_sum,
            "peak_pss_sum_bytes": self.peak_pss_sum,
            "peak_rss_single_bytes": self.peak_rss_single,
            "samples": self.samples,
        }

    def _procs(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._active.wait(self.interval):
                continue  # paused: look again for a stop or a resume
            with self._sampling:
                if not self._active.is_set():
                    continue  # paused between the wait and the lock
                if not self.sample(self.pss_every > 0 and self.samples % self.pss_every == 0):
                    return
            self._stop.wait(self.interval)

    def sample(self, with_pss: bool) -> bool:
        """One sample of the tree now (RSS, and PSS if asked); False once it is gone. From
        another thread only while paused."""
        procs = self._procs()
        if not procs:
            return False
        rss_sum = pss_sum = 0
        for proc in procs:
            try:
                if with_pss:
                    info = proc.memory_full_info()
                    pss_sum += info.pss
                else:
                    info = proc.memory_info()
            except psutil.Error:
                continue
            rss_sum += info.rss
            self.peak_rss_single = max(self.peak_rss_single, info.rss)
        self.peak_rss_sum = max(self.peak_rss_sum, rss_sum)
        self.peak_pss_sum = max(self.peak_pss_sum, pss_sum)
        self.samples += 1
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--json-out", default=None)
    record.add_argument(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    start = time.perf_counter()
    proc = subprocess.Popen(command)
    sampler = TreeSampler(proc.pid, args.interval).start()
    rc = proc.wait()
    result = {**sampler.stop(), "wall_s": time.perf_counter() - start, "returncode": rc}
    gib = 2**30
    print(
        f"peak RSS (tree sum) {result['peak_rss_sum_bytes'] / gib:.2f} GiB, "
        f"peak PSS (tree sum) {result['peak_pss_sum_bytes'] / gib:.2f} GiB, "
        f"largest process {result['peak_rss_single_bytes'] / gib:.2f} GiB, "
        f"{result['samples']} samples, {result['wall_s']:.1f} s, rc {rc}"
    )
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"command": command, **result}, f, indent=2)
    if args.record is not None:
        rows: list[list[record.Cell]] = [
            ["peak RSS, summed over the tree", f"{result['peak_rss_sum_bytes'] / gib:.2f} GiB"],
            ["peak PSS, summed over the tree", f"{result['peak_pss_sum_bytes'] / gib:.2f} GiB"],
            ["largest process's peak RSS", f"{result['peak_rss_single_bytes'] / gib:.2f} GiB"],
            [
                "samples, wall time, exit code",
                f"{result['samples']}, {result['wall_s']:.1f} s, {rc}",
            ],
        ]
        record.save(
            args.record or "peak_rss",
            "Peak memory of the command's whole process tree",
            ["measure", "value"],
            rows,
            f"Sampled with psutil every {args.interval} s; RSS sums count shared pages once per "
            "process, PSS splits them between their sharers (the tree's real footprint).",
        )
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
