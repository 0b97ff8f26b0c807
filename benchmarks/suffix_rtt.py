#!/usr/bin/env python
"""Suffix decoding through the gateway with the drafter on a network host of its own, at a given
drafter-verifier round trip: how much of each step waits for the drafter.

Valkey, drafter, verifier and gateway each in a network namespace (tandem/tools/netns.py), the
drafter-verifier link through the delaying proxy at --rtt-ms (jitter a tenth). `tandem bench`
through the gateway runs plain decoding and suffix decoding on `code_twice` (each HumanEval prompt
asked again, renamed, in a later session: the drafter's store serves the second ask), interleaved per
prompt. Run it from two checkouts, alternately, to compare builds (each imports its own code):

    sudo .venv/bin/python benchmarks/suffix_rtt.py --rtt-ms 5 --out docs/results/<host>/suffix-rtt/new1.json

Needs root (namespaces). Nothing else CPU-heavy may run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.engine.native.build import cpu_model  # noqa: E402
from tandem.tools.bench import run_bench  # noqa: E402
from tandem.tools.bench_remote import GatewayTarget  # noqa: E402
from tandem.tools.datasets import records_for  # noqa: E402
from tandem.tools.stack import Stack, StackConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt-ms", type=float, default=5.0, help="drafter-verifier round trip")
    ap.add_argument("--dataset", default="code_twice", help="workload or dev set (tandem bench --dataset)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True, help="JSON to write")
    args = ap.parse_args()
    from tandem.tools.netns import NetnsTopology

    records = records_for(args.dataset, args.limit)
    os.environ.pop("TANDEM_REDIS_URL", None)
    topo = NetnsTopology(verifiers=1)
    cfg = StackConfig(log_level="warning", metrics=False, topology=topo)
    with Stack(cfg) as stack:
        target = GatewayTarget(stack.grpc_address)
        run_bench(target, records[:1], ["ar"], 16, progress=False)  # lazy initialisation on every tier
        topo.links["drafter"].set_delay(args.rtt_ms, jitter_ms=args.rtt_ms / 10)
        started = time.monotonic()
        result = run_bench(target, records, ["ar", "suffix"], args.max_new_tokens, progress=False)
    ar, sx = result["modes"]["ar"], result["modes"]["suffix"]
    out = {"cpu": cpu_model(), "rtt_ms": args.rtt_ms, "dataset": args.dataset, "prompts": len(records),
           "max_new_tokens": args.max_new_tokens, "seconds": round(time.monotonic() - started, 1),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "ar_tokens_per_s": ar["tokens_per_s"], "suffix_tokens_per_s": sx["tokens_per_s"],
           "whole_run": sx["tokens_per_s"] / ar["tokens_per_s"], "median": sx["speedup_vs_ar"],
           "lossless": sx["lossless"], "steps": sx.get("steps"), "acceptance_rate": sx.get("acceptance_rate"),
           "fallback_steps": sx.get("fallback_steps")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"rtt {args.rtt_ms} ms: suffix {out['whole_run']:.3f}x whole run, {out['median']:.3f}x median, "
          f"lossless {out['lossless']:.0%}, {out['steps']} steps -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
