"""Summarise a py-spy speedscope profile: top functions by self and by inclusive time.

    py-spy record --format speedscope -o prof.json -- pagekv bench --workload random
    python benchmarks/profile_summary.py prof.json [--top 25] [--under step]

Percentages are of all samples of the profile's threads (``--under NAME`` restricts the
denominator and the tables to samples whose stack contains a frame named NAME, e.g. ``step``
for the engine's steps without model loading; a frame matches by its name or by
``Class.NAME``). A frame is "function (file:line)" as py-spy
names it; a torch op called from Python is charged to the Python line that calls it.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def frame_label(frame: dict[str, object]) -> str:
    file = Path(str(frame.get("file", ""))).name
    return f"{frame['name']} ({file}:{frame.get('line', '?')})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--under", default=None, help="only samples below a frame of this name")
    args = parser.parse_args()
    data = json.loads(Path(args.profile).read_text(encoding="utf-8"))
    frames = data["shared"]["frames"]
    labels = [frame_label(f) for f in frames]
    self_w: Counter[str] = Counter()
    incl_w: Counter[str] = Counter()
    total = 0.0
    for profile in data["profiles"]:
        for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
            if args.under and not any(
                frames[i]["name"] == args.under or str(frames[i]["name"]).endswith(f".{args.under}")
                for i in stack
            ):
                continue
            total += weight
            if stack:
                self_w[labels[stack[-1]]] += weight
            for label in {labels[i] for i in stack}:
                incl_w[label] += weight
    # py-spy's speedscope weights are seconds of sampled wall time
    print(f"{total:.1f} s sampled" + (f" under {args.under!r}" if args.under else ""))
    for title, counter in (("self", self_w), ("inclusive", incl_w)):
        print(f"\ntop {args.top} by {title} time")
        for label, weight in counter.most_common(args.top):
            print(f"{100 * weight / total:6.1f}%  {label}")


if __name__ == "__main__":
    main()
