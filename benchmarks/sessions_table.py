#!/usr/bin/env python
"""Markdown tables of benchmarks/sessions_bench.sh's before/after runs: aggregate tokens/s per
session count, median (min-max) over the repeats, plain and with suffix decoding; and what the
verifier did at the highest count (prefill computed / recomputed after evictions / shared,
evictions, rows per step, KV occupancy, errors), medians over the repeats.

    python benchmarks/sessions_table.py docs/results/epyc/sessions
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _runs(folder: Path, build: str) -> list[dict]:
    paths = sorted(folder.glob(f"{build}.json")) + sorted(folder.glob(f"{build}_[0-9]*.json"))
    return [{(r["concurrency"], r["speculation"]): r for r in json.loads(p.read_text())["results"]} for p in paths]


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def main(folder: str) -> None:
    root = Path(folder)
    builds = {b: _runs(root, b) for b in ("before", "after")}
    levels = sorted({c for runs in builds.values() for run in runs for c, _ in run})
    n = {b: len(r) for b, r in builds.items()}
    print(f"Aggregate tokens/s, median (min-max) of {n['before']} runs before and {n['after']} after:\n")
    print("| sessions | before, plain | after, plain | before, suffix | after, suffix |")
    print("|---:|---:|---:|---:|---:|")
    for c in levels:
        cells = [_spread([run[(c, spec)]["tokens_per_s"] for run in builds[b] if (c, spec) in run])
                 for spec in (False, True) for b in ("before", "after")]
        print(f"| {c} | " + " | ".join(cells) + " |")
    top = levels[-1]
    print(f"\nWhat the verifier did at {top} sessions (medians over the runs):\n")
    print("| build | mode | prefill computed | of it recomputed after evictions | shared (copied) | evictions "
          "| rows / step | KV mean / max of budget | errors |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for b in ("before", "after"):
        for spec in (False, True):
            rows = [run[(top, spec)] for run in builds[b] if (top, spec) in run and "server" in run[(top, spec)]]
            if not rows:
                continue

            def med(key: str) -> float:
                return statistics.median(r["server"][key] for r in rows)

            print(f"| {b} | {'suffix' if spec else 'plain'} | {med('prefill_computed_tokens'):.0f} "
                  f"| {med('recomputed_tokens'):.0f} ({statistics.median(r['server']['recomputed_share'] for r in rows):.0%}) "
                  f"| {med('prefix_shared_tokens'):.0f} | {med('evictions'):.0f} | {med('rows_per_step'):.1f} "
                  f"| {med('kv_used_mean_tokens'):.0f} / {med('kv_used_max_tokens'):.0f} of {med('kv_capacity_tokens'):.0f} "
                  f"| {statistics.median(r['errors'] for r in rows):.0f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/results/epyc/sessions")
