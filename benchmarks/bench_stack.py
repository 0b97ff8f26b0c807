#!/usr/bin/env python
"""Distributed measurements for docs/benchmarks.md: bring up a local stack (`tandem up`: Valkey,
drafter, verifier, gateway as separate processes), then

1. `tandem bench --endpoint` on the dev sets (greedy, ar vs ngram through the gateway), to compare
   with the in-process figures of scripts/bench_docs.py;
2. `tandem loadtest` (concurrent multi-turn sessions, speculation off and on).

    .venv/bin/python benchmarks/bench_stack.py [--limit 10] [--skip-bench] [--skip-loadtest]

Results: docs/results/stack_<set>.json, docs/results/loadtest.json and docs/results/loadtest.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.tools.datasets import DEV_SETS, PROMPTS_DIR  # noqa: E402
from tandem.tools.stack import Stack, StackConfig, free_port  # noqa: E402

DATA = PROMPTS_DIR
SETS = DEV_SETS


KEEP = ("<!-- keep -->", "<!-- /keep -->")
# A person's reading of the distributed numbers, inside the keep block: it survives a re-run.
READING = ("<!-- stack-reading -->", "<!-- /stack-reading -->")


def _median_limit(result: dict, mode: str, limit: int | None) -> float | None:
    """speedup_vs_ar over the first `limit` prompts of a result (the in-process run may have more)."""
    from tandem.tools.bench import median_speedup

    prompts = result["prompts"][:limit] if limit else result["prompts"]
    ar = [(p["modes"]["ar"]["seconds"], p["modes"]["ar"]["tokens"]) for p in prompts]
    mo = [(p["modes"][mode]["seconds"], p["modes"][mode]["tokens"]) for p in prompts]
    return median_speedup(ar, mo)


def render(results: Path, reading: str = "") -> str:
    """The distributed and load-test sections of docs/benchmarks.md, from the JSON results, with
    `reading` (the text kept between the READING markers) after them."""
    lines = [KEEP[0], "## Distributed: the same modes through a local stack", "",
             "`tandem bench --endpoint` through `tandem up` (Valkey, drafter, verifier and gateway as separate "
             "processes on this machine, gRPC between them), against the in-process figures of the same prompts "
             "(the first N of the in-process run above). Regenerate: `.venv/bin/python benchmarks/bench_stack.py`.", "",
             "| dataset | prompts | ngram speedup, stack | ngram speedup, in process | tok/step, stack | lossless, stack |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, _ in SETS:
        stack_file, local_file = results / f"stack_{name}.json", results / f"{name}.json"
        if not stack_file.exists():
            continue
        st = json.loads(stack_file.read_text())
        n = len(st["prompts"])
        local = _median_limit(json.loads(local_file.read_text()), "ngram", n) if local_file.exists() else None
        m = st["modes"]["ngram"]
        lines.append(f"| {name} | {n} | {m['speedup_vs_ar']:.2f}x | "
                     f"{'-' if local is None else f'{local:.2f}x'} | {m['mean_accepted_len'] or 0:.2f} | "
                     f"{round(m['lossless'] * n)}/{n} |")
    lt = results / "loadtest.json"
    if lt.exists():
        data = json.loads(lt.read_text())
        cfg = data.get("config", {})
        lines += ["", "## Load test: concurrent multi-turn sessions", "",
                  f"`tandem loadtest` against the same stack: {cfg.get('turns')} turns per conversation "
                  f"(MT-Bench), {cfg.get('max_tokens')} tokens per turn, greedy; one verifier, batched forwards.", "",
                  "| sessions | speculation | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
                  "acceptance | residency hits | requests |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in data["results"]:
            def f(v, pat="{:.0f}"):
                return "-" if v is None else pat.format(v)
            lines.append(
                f"| {r['concurrency']} | {'on' if r['speculation'] else 'off'} | {r['tokens_per_s']:.1f} | "
                f"{f(r['ttft_p50_ms'])} | {f(r['ttft_p99_ms'])} | {f(r['itl_p50_ms'], '{:.1f}')} | "
                f"{f(r['itl_p99_ms'], '{:.1f}')} | {f(r['acceptance_rate'], '{:.0%}')} | "
                f"{f(r['residency_hit_rate'], '{:.0%}')} | {r['requests']} |")
        lines += ["", "![Load test](results/loadtest.png)"]
    lines += ["", READING[0], reading.strip("\n") or "_No reading written yet._", READING[1], KEEP[1]]
    return "\n".join(lines) + "\n"


def write_doc(results: Path, doc: Path) -> None:
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    reading = ""
    if READING[0] in text and READING[1] in text:
        reading = text[text.index(READING[0]) + len(READING[0]) : text.index(READING[1])]
    block = render(results, reading)
    if KEEP[0] in text:
        start = text.index(KEEP[0])
        end = text.index(KEEP[1], start) + len(KEEP[1])
        text = text[:start] + block.rstrip("\n") + text[end:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    doc.write_text(text)
    print(f"wrote {doc}")


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
    ap.add_argument("--conversations", type=int, default=2, help="conversations per concurrent worker")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--doc-only", action="store_true", help="only rewrite the section of docs/benchmarks.md")
    args = ap.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    doc = ROOT / "docs" / "benchmarks.md"
    if args.doc_only:
        write_doc(args.results, doc)
        return 0
    tandem = [sys.executable, "-m", "tandem.tools.cli"]
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
                "--max-tokens", "64", "--duration", "180", "--conversations", str(args.conversations),
                "--out", str(args.results / "loadtest.json"),
            ], check=True)
    write_doc(args.results, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
