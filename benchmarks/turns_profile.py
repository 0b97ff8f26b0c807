#!/usr/bin/env python
"""The stack's load-test workload in process: `c` workers, each `--conversations` two-turn MT-Bench
conversations one after another (turn 2 = turn 1, its reply, the next question; same session, so its
KV is reused), through one VerifierCore's step loop, speculation off and on in the order given.
Unlike benchmarks/loop_profile.py (one burst of prompts), arrivals spread out and steps carry prompt
pieces beside decoding rows, as through `tandem up`. Per run: tokens/s, acceptance, rows and tokens
a step; `--out DIR` also writes each run's steps (rows, tokens, committed, prompt tokens, forward s,
plan s) and the cost curve the planner read at its end. Nothing else CPU-heavy may run meanwhile.

    .venv/bin/python benchmarks/turns_profile.py -c 64 --modes off,on,off,on --out docs/results/epyc/cost-curve
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loop_profile import timed_threads  # noqa: E402  (beside this script)
from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig  # noqa: E402
from tandem.engine.model.loading import load_model  # noqa: E402
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.native.threads import in_passing_thread  # noqa: E402
from tandem.services.verifier.core import VerifierCore  # noqa: E402
from tandem.services.verifier.settings import VerifierSettings  # noqa: E402
from tandem.tools.datasets import dev_set, load_prompts  # noqa: E402

SPECS = {"off": SpecConfig(strategy=DraftStrategy.none), "on": SpecConfig(strategy=DraftStrategy.ngram)}


def run(core: VerifierCore, records, c: int, conversations: int, mode: str, tag: str, max_tokens: int) -> tuple[dict, list]:
    tok, ex = core.target.tokenizer, core.executor
    first = ex.steps_planned
    sampling = SamplingParams(max_new_tokens=max_tokens)
    barrier = threading.Barrier(c + 1)
    lock = threading.Lock()
    totals = {"tokens": 0, "drafted": 0, "accepted": 0}
    ttft: list[float] = []

    def worker(i: int) -> None:
        from tandem.serving.grpc_server import handler_thread

        handler_thread()  # as a gRPC handler: no OpenMP pool of its own
        barrier.wait()
        for j in range(conversations):
            rec = records[(i * conversations + j) % len(records)]
            messages = [{"role": "system", "content": rec.system}] if rec.system else []
            for user in rec.turns[:2]:
                messages.append({"role": "user", "content": user})
                res = list(core.generate(f"{tag}-{i}-{j}", apply_chat_template(tok, messages), sampling, SPECS[mode]))[-1]
                with lock:
                    totals["tokens"] += len(res.token_ids)
                    totals["drafted"] += res.stats.drafted
                    totals["accepted"] += res.stats.accepted
                    ttft.append(res.first_token_seconds)
                messages.append({"role": "assistant", "content": tok.decode(res.token_ids, skip_special_tokens=True)})

    wall = timed_threads(worker, c, barrier)
    steps = list(ex.phases)[-(ex.steps_planned - first):]
    row = {"mode": mode, "concurrency": c, "tokens_per_s": totals["tokens"] / wall, "wall_s": wall, **totals,
           "acceptance": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
           "ttft_p50_s": statistics.median(ttft), "steps": len(steps),
           "rows_per_step": statistics.mean(p.rows for p in steps),
           "tokens_per_step": statistics.mean(p.tokens for p in steps),
           "committed_per_step": statistics.mean(p.committed for p in steps),
           "plan_s": sum(p.plan for p in steps), "forward_s": sum(p.forward for p in steps)}
    return row, [[p.rows, p.tokens, p.committed, p.pieces, p.forward, p.plan] for p in steps]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--concurrency", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--modes", default="off,on,off,on")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    core = in_passing_thread(lambda: VerifierCore(VerifierSettings(verifier_id="profile", port=0, max_sessions=256,
                                                                   kv_capacity_tokens=10**7), load_model()))
    records = load_prompts(dev_set("mt_bench"), 80)
    rows = []
    for i, mode in enumerate(args.modes.split(",")):
        row, steps = run(core, records, args.concurrency, args.conversations, mode, f"r{i}", args.max_tokens)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"steps_{i}_{mode}.json").write_text(json.dumps(steps))
            curve = core.engine.runner.costs.points
            (args.out / f"curve_{i}_{mode}.json").write_text(json.dumps({str(k): v for k, v in sorted(curve.items())}))
    if args.out:
        (args.out / "turns_profile.json").write_text(json.dumps(
            {"rows": rows, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))


if __name__ == "__main__":
    main()
