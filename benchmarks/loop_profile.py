#!/usr/bin/env python
"""The verifier's step loop under concurrent sessions, in process (no gRPC, no gateway): where a
step's time goes (plan, forward, verify, commit) and aggregate tokens/s, speculation off and on.

Each level runs `c` sessions at once through one VerifierCore on the default model (MT-Bench
prompts, greedy, --max-tokens each; at least 8 prompts a level, a worker's one after another); handlers are threads that only read, as the gRPC server's.
Each run has a cache salt of its own, so no run reuses another's prompts from sessions left resident;
TTFT is a request's start to its first streamed step.
`--pricing old,new` alternates how a plan prices its drafts within the batch (new: against what the
other rows of the last step committed; old: one token per other row, as before df36550), in one
process, so machine drift falls on both alike. Nothing else CPU-heavy may run meanwhile.

    .venv/bin/python benchmarks/loop_profile.py -c 1,8,16,32 --repeat 2 --out docs/results/epyc/sched/loop_profile.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("tandem") is None:  # not installed: run from the checkout
    sys.path.insert(0, str(ROOT))

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig  # noqa: E402
from tandem.engine.model.loading import load_model  # noqa: E402
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.native.threads import in_passing_thread  # noqa: E402
from tandem.engine.scheduler.generate import Generation  # noqa: E402
from tandem.services.verifier.core import VerifierCore  # noqa: E402
from tandem.services.verifier.settings import VerifierSettings  # noqa: E402
from tandem.tools.datasets import load_prompts, dev_set, to_chat  # noqa: E402

NEW_LOAD = Generation._batch_load
MIN_PROMPTS = 8


def _old_load(self) -> tuple[int, float]:
    """The pricing before df36550: every other job of the last forward (prompt pieces too) commits
    one token."""
    ex = self.runner.executor
    if ex is None or self.replayable or ex.last_batch_size <= 1:
        return 0, 0.0
    others = ex.last_batch_size - 1
    per_job = ex.last_batch_tokens / ex.last_batch_size
    return int(round(others * per_job)), float(others)


def timed_threads(target, c: int, barrier: threading.Barrier) -> float:
    """Run `target(i)` in c threads that wait on `barrier` (c + 1 parties) before their work: the
    seconds from releasing them together until the last one ended."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def run_level(core: VerifierCore, prompts: list[list[int]], c: int, spec: SpecConfig, max_tokens: int,
              tag: str) -> dict:
    ex = core.executor
    first = ex.steps_planned  # (phases is bounded: count steps, then take the newest)
    sampling = SamplingParams(max_new_tokens=max_tokens)
    barrier = threading.Barrier(c + 1)

    total = max(c, MIN_PROMPTS)  # at least MIN_PROMPTS prompts a level: one prompt says little
    results = [None] * total
    ttft = [0.0] * total  # seconds from a request's start to its first streamed step

    def session(i: int) -> None:
        from tandem.serving.grpc_server import handler_thread

        handler_thread()  # as a gRPC handler: no OpenMP pool of its own (tandem.engine.native.threads)
        barrier.wait()
        for j in range(i, total, c):  # worker i runs prompts i, i + c, ... one after another
            start = time.perf_counter()
            items = []
            # a salt per run: no run copies another's prompts from its sessions left resident
            # (before 2026-12-07 the later mode of a level did, and prefilled almost nothing)
            for item in core.generate(f"{tag}-{j}", prompts[j % len(prompts)], sampling, spec, cache_salt=tag):
                if not items:
                    ttft[j] = time.perf_counter() - start
                items.append(item)
            results[j] = items[-1]

    wall = timed_threads(session, c, barrier)
    ran = ex.steps_planned - first
    phases = list(ex.phases)[-ran:] if ran else []
    tokens = sum(len(r.token_ids) for r in results)
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    full = [p for p in phases if p.rows == c and not p.pieces]  # steps with every session decoding

    def med(name: str, steps) -> float | None:
        return 1e3 * statistics.median(getattr(p, name) for p in steps) if steps else None

    return {
        "tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "steps": len(phases),
        "acceptance": accepted / drafted if drafted else None, "drafted": drafted,
        "full_steps": len(full),
        "ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_max_ms": 1e3 * max(ttft),
        "rows_per_step": statistics.mean(p.rows for p in phases) if phases else 0,
        "tokens_per_step_full": statistics.mean(p.tokens for p in full) if full else None,
        "committed_per_step_full": statistics.mean(p.committed for p in full) if full else None,
        **{f"{name}_ms_full": med(name, full) for name in ("plan", "forward", "verify", "commit")},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--concurrency", default="1,8,16,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--pricing", default="new", help="comma-separated: new, old (alternated per level)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    console = Console()
    # As the verifier's serve() does: no model work on this thread (tandem.engine.native.threads)
    core = in_passing_thread(lambda: VerifierCore(VerifierSettings(verifier_id="profile", port=0, max_sessions=256,
                                                                   kv_capacity_tokens=10**7), load_model()))
    loaded = core.target
    records = load_prompts(dev_set("mt_bench"), 64)
    prompts = [apply_chat_template(loaded.tokenizer, to_chat(r)) for r in records]
    levels = [int(x) for x in args.concurrency.split(",")]
    pricings = args.pricing.split(",")
    specs = {"off": SpecConfig(strategy=DraftStrategy.none), "on": SpecConfig(strategy=DraftStrategy.ngram)}
    # warm up: the cost model and the kernels
    run_level(core, prompts, 4, specs["on"], 32, "warm")
    rows = []
    total = args.repeat * len(levels) * len(pricings) * 2
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("levels", total=total)
        for rep in range(args.repeat):
            for c in levels:
                for pricing in pricings:
                    Generation._batch_load = NEW_LOAD if pricing == "new" else _old_load
                    for mode, spec in specs.items():
                        # fresh session ids per run: every prompt is prefilled the same way
                        r = run_level(core, prompts, c, spec, args.max_tokens, f"r{rep}-{c}-{pricing}-{mode}")
                        rows.append({"repeat": rep, "concurrency": c, "pricing": pricing, "speculation": mode, **r})
                        bar.advance(task)
                        console.print(f"c={c:<3} {pricing:<4} spec={mode:<3} {r['tokens_per_s']:7.1f} tok/s  "
                                      f"TTFT p50 {r['ttft_p50_ms']:6.0f} ms  steps {r['steps']:5d}  acc {r['acceptance'] or 0:.2f}  plan/fwd/verify/commit ms "
                                      + " / ".join(f"{r[k + '_ms_full']:.2f}" if r[k + '_ms_full'] is not None else "-"
                                                   for k in ("plan", "forward", "verify", "commit")))
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    report = {"cpu": model, "precision": core.engine.runner.precision,
              "threads": torch.get_num_threads(), "max_tokens": args.max_tokens, "rows": rows,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
