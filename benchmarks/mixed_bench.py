#!/usr/bin/env python
"""Chunked prefill, measured (issue 14): the mixed workload through a local stack, in one sitting.

Stacks in turn on the embedded SmolLM2, the same build, the same machine:
  one-piece   --prefill-chunk-tokens 8192 --prefill-min-tokens 8192: a prompt runs as one forward,
              as the verifier did before chunked prefill;
  chunked     the defaults (pieces of at most 256 tokens, a step with pieces at most 2x the cost of
              the step without them);
  chunked-1.5 (--configs) the same with --prefill-cost-factor 1.5;
  chunked-min4 (--configs) the same with --prefill-min-tokens 4.
  chunked-min1 (--configs) the same with --prefill-min-tokens 1.
For each: `tandem loadtest --mixed` at the given concurrencies (short MT-bench chats, alone, then
while 4k-7.5k-token prompts arrive one after another). Nothing else may run meanwhile.

    .venv/bin/python benchmarks/mixed_bench.py [--concurrency 1,4] [--duration 75] [--configs one-piece,chunked] [--out docs/results/intel/mixed.json]
    .venv/bin/python benchmarks/mixed_bench.py --table docs/results/intel/mixed/mixed.json   # the markdown table
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.engine.native.build import cpu_model  # noqa: E402
from tandem.tools.datasets import dev_set, load_prompts  # noqa: E402
from tandem.tools.loadtest import run_mixed  # noqa: E402
from tandem.tools.stack import Stack, StackConfig, free_port  # noqa: E402

CONFIGS = {
    "one-piece": ("--prefill-chunk-tokens", "8192", "--prefill-min-tokens", "8192"),
    "chunked": (),
    # a step with pieces at most 1.5x the step without (the default is 2): shorter gaps while a
    # long prompt is prefilled, a longer prefill
    "chunked-1.5": ("--prefill-cost-factor", "1.5"),
    # pieces down to 4 tokens (the default since the EPYC run; it was 16): at long context 16 tokens of attention
    # can cost more than the decoding step, so the floor, not the cost factor, sets the step
    "chunked-min4": ("--prefill-min-tokens", "4"),
    # pieces down to one token: at 7k context a step that reads the prompt's KV costs ~2.5x a lone
    # decoding step whatever its piece (EPYC), so the floor adds compute to a memory-bound step
    "chunked-min1": ("--prefill-min-tokens", "1"),
}


def _ms(v) -> str:
    return "-" if v is None else f"{v:,.0f}"


def table(report: dict) -> str:
    """docs/benchmarks.md's table: per prefill, concurrency and speculation, the phase alone and
    with long prompts arriving."""
    lines = [f"CPU: {report['cpu']}, {report['date']}.", "",
             "| prefill | sessions | speculation | long prompts | tokens/s | chunk gap p50 / p99 ms | gap p99 during a long prefill ms "
             "| short TTFT p50 / p99 ms | short TTFT p99, started during a long prefill ms | long prompts: tokens, TTFT s |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for name, cfg in report["configs"].items():
        for r in cfg["mixed"]:
            longs = ", ".join(f"{t:,} in {ms / 1000:.1f}" for t, ms in zip(r["long_prompt_tokens"], r["long_ttft_ms"])) or "-"
            during = (f"{_ms(r['ttft_during_long_p99_ms'])} ({r['requests_started_during_long']} requests)"
                      if r["with_long"] else "-")
            lines.append(
                f"| {name} | {r['concurrency']} | {'on' if r['speculation'] else 'off'} | {'yes' if r['with_long'] else 'no'} "
                f"| {r['tokens_per_s']:.1f} | {_ms(r['gap_p50_ms'])} / {_ms(r['gap_p99_ms'])} "
                f"| {_ms(r['gap_during_long_p99_ms']) if r['with_long'] else '-'} "
                f"| {_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p99_ms'])} | {during} | {longs} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--duration", type=float, default=75.0, help="seconds per phase")
    ap.add_argument("--long-tokens", default="4000,7500")
    ap.add_argument("--spec", default="on", choices=["on", "off", "both"])
    ap.add_argument("--out", type=Path, default=ROOT / "docs/results/intel/mixed.json")
    ap.add_argument("--configs", default="one-piece,chunked", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--table", type=Path, help="only print the markdown table of a report")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    records = load_prompts(dev_set("mt_bench"))
    levels = [int(c) for c in args.concurrency.split(",")]
    sizes = [int(t) for t in args.long_tokens.split(",")]
    spec = {"on": (True,), "off": (False,), "both": (False, True)}[args.spec]
    report = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "configs": {}}
    for name in args.configs.split(","):
        vargs = CONFIGS[name]
        cfg = StackConfig(http_port=free_port(), grpc_port=free_port(), log_level="warning", metrics=False,
                          verifier_args=vargs)
        print(f"== {name}: verifier {' '.join(vargs) or '(defaults)'}", flush=True)
        with Stack(cfg) as stack:
            def show(row: dict) -> None:
                print(f"  c={row['concurrency']} spec={'on' if row['speculation'] else 'off'} "
                      f"long={'yes' if row['with_long'] else 'no'}: {row['tokens_per_s']:.1f} tok/s, gap p50 "
                      f"{row['gap_p50_ms'] or 0:.0f} p99 {row['gap_p99_ms'] or 0:.0f} ms, during long p99 "
                      f"{row['gap_during_long_p99_ms'] or 0:.0f} ms, TTFT p99 {row['ttft_p99_ms'] or 0:.0f} ms "
                      f"(during long {row['ttft_during_long_p99_ms'] or 0:.0f}), long TTFT {row['long_ttft_ms']} "
                      f"tokens {row['long_prompt_tokens']}, errors {row['errors']}+{row['long_errors']}", flush=True)

            report["configs"][name] = {
                "verifier_args": list(vargs),
                **run_mixed(stack.http_url, records, levels, long_tokens=sizes, long_gap_s=2.0, turns=2,
                            max_tokens=64, duration_s=args.duration, speculation=spec, on_phase=show),
            }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    print(table(report))


if __name__ == "__main__":
    main()
