#!/usr/bin/env python
"""Distributed measurements for docs/benchmarks.md: bring up a local stack (`tandem up`: Valkey,
drafter, verifier, gateway as separate processes), then

1. `tandem bench --endpoint` on the dev sets (greedy, ar vs ngram through the gateway), to compare
   with the in-process figures of scripts/bench_docs.py;
2. `tandem loadtest` (concurrent multi-turn sessions, speculation off and on).

    .venv/bin/python scripts/bench_stack.py [--limit 10] [--skip-bench] [--skip-loadtest]

Results: docs/results/stack_<set>.json, docs/results/loadtest.json and docs/results/loadtest.png.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.stack import Stack, StackConfig, free_port  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
SETS = [
    ("bfcl_multiple", "bfcl/BFCL_v4_multiple.json"),
    ("humaneval", "HumanEval.jsonl"),
    ("gsm8k", "gsm8k_question.jsonl"),
    ("mt_bench", "mt_bench_question.jsonl"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sets", default=",".join(n for n, _ in SETS))
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-loadtest", action="store_true")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--loadtest-dataset", default="mt_bench_question.jsonl")
    ap.add_argument("--loadtest-limit", type=int, default=32)
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    args = ap.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    tandem = [sys.executable, "-m", "tandem.cli"]
    cfg = StackConfig(http_port=free_port(), grpc_port=free_port(), log_level="warning")
    with Stack(cfg) as stack:
        print(f"stack up: http {stack.http_url}, grpc {stack.grpc_address}", flush=True)
        if not args.skip_bench:
            wanted = set(args.sets.split(","))
            for name, rel in SETS:
                if name not in wanted:
                    continue
                subprocess.run(tandem + [
                    "bench", "--endpoint", stack.grpc_address, "--dataset", str(DATA / rel), "--limit", str(args.limit),
                    "--max-new-tokens", str(args.max_new_tokens), "--modes", "ar,ngram",
                    "--out", str(args.results / f"stack_{name}.json"),
                ], check=True)
        if not args.skip_loadtest:
            subprocess.run(tandem + [
                "loadtest", "--endpoint", stack.http_url, "--dataset", str(DATA / args.loadtest_dataset),
                "--limit", str(args.loadtest_limit), "--concurrency", args.concurrency, "--turns", "2",
                "--max-tokens", "64", "--duration", "180", "--out", str(args.results / "loadtest.json"),
            ], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
