#!/usr/bin/env python
"""A markdown table of `tandem loadtest` sweeps side by side (benchmarks/sweep_bench.sh's JSON files):
tokens/s per run, speculation against plain per run, ITL p50/p99 and errors.

    python benchmarks/sweep_table.py docs/results/epyc/sched/sweep_before.json docs/results/epyc/sched/sweep_after.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    runs = {Path(p).stem: {(r["concurrency"], r["speculation"]): r for r in json.loads(Path(p).read_text())["results"]}
            for p in paths}
    names = list(runs)
    levels = sorted({c for run in runs.values() for c, _ in run})
    print("| sessions | " + " | ".join(f"{n}: plain / spec tok/s (ratio)" for n in names)
          + " | ITL p50 / p99 ms, spec (" + names[-1] + ") | errors |")
    print("|---:|" + "---:|" * len(names) + "---:|---:|")
    for c in levels:
        cells = []
        errors = 0
        for n in names:
            off, on = runs[n].get((c, False)), runs[n].get((c, True))
            if off is None or on is None:
                cells.append("-")
                continue
            errors += off["errors"] + on["errors"]
            cells.append(f"{off['tokens_per_s']:.1f} / {on['tokens_per_s']:.1f} "
                         f"({on['tokens_per_s'] / off['tokens_per_s']:.2f}x)")
        last = runs[names[-1]].get((c, True))
        itl = f"{last['itl_p50_ms']:.1f} / {last['itl_p99_ms']:.1f}" if last else "-"
        print(f"| {c} | " + " | ".join(cells) + f" | {itl} | {errors} |")


if __name__ == "__main__":
    main(sys.argv[1:])
