#!/usr/bin/env python
"""One long prompt beside decoding streams, in process, step by step (issue 14's mixed workload
without gRPC): a VerifierCore's step loop serves `--streams` chat sessions (default 1) that ask
MT-Bench questions back to back (64 tokens each, prompt lookup), and after 3 s one long prompt (8
output tokens, plain) arrives. Reports the stream's gaps between streamed steps outside and during the long
prefill, and the loop's steps by kind: decoding only, decoding rows with a prompt piece, a prompt
piece alone (no stream decoding at that moment: between two of its requests). Nothing else CPU-heavy
may run meanwhile.

    .venv/bin/python scripts/mixed_probe.py [--streams 1] [--min-piece 4] [--cost-factor 2] [--long-tokens 7000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.engine.config import DraftStrategy, SamplingParams, SpecConfig  # noqa: E402
from tandem.engine.gemm import cpu_model  # noqa: E402
from tandem.engine.models import apply_chat_template, load_model  # noqa: E402
from tandem.engine.threads import in_passing_thread  # noqa: E402
from tandem.serving.grpc_server import handler_thread  # noqa: E402
from tandem.services.verifier.core import VerifierCore  # noqa: E402
from tandem.services.verifier.settings import VerifierSettings  # noqa: E402
from tandem.tools.datasets import dev_set, load_prompts  # noqa: E402


def pct(xs: list[float], p: float) -> float | None:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-piece", type=int, default=VerifierSettings.model_fields["prefill_min_tokens"].default,
                    help="the verifier's --prefill-min-tokens")
    ap.add_argument("--cost-factor", type=float,
                    default=VerifierSettings.model_fields["prefill_cost_factor"].default,
                    help="the verifier's --prefill-cost-factor")
    ap.add_argument("--long-tokens", type=int, default=7000, help="the long prompt's length")
    ap.add_argument("--streams", type=int, default=1, help="chat sessions decoding meanwhile")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    core = in_passing_thread(lambda: VerifierCore(
        VerifierSettings(verifier_id="probe", port=0, prefill_min_tokens=args.min_piece,
                         prefill_cost_factor=args.cost_factor), load_model()))
    tok, ex = core.target.tokenizer, core.executor
    ex.history = deque(maxlen=1 << 20)  # every step of the run: the slices below index it
    records = load_prompts(dev_set("mt_bench"), 80)
    long_ids = tok(" ".join(r.turns[0] for r in records) * 10)["input_ids"][: args.long_tokens]
    stop = threading.Event()
    arrivals: list[tuple[float, tuple[int, int]]] = []  # (time, (stream, request)): one per streamed step
    span: dict = {}

    def chat(stream: int) -> None:
        handler_thread()  # as a gRPC handler: no OpenMP pool of its own
        i = 0
        while not stop.is_set():
            i += 1
            q = records[(i * args.streams + stream) % len(records)].turns[0]
            ids = apply_chat_template(tok, [{"role": "user", "content": q}])
            for _ in core.generate(f"chat-{stream}-{i}", ids, SamplingParams(max_new_tokens=64),
                                   SpecConfig(strategy=DraftStrategy.ngram)):
                arrivals.append((time.perf_counter(), (stream, i)))

    def long_prompt() -> None:
        handler_thread()
        time.sleep(3.0)
        span["steps_before"] = len(ex.history)
        span["start"] = time.perf_counter()
        list(core.generate("long", long_ids, SamplingParams(max_new_tokens=8), SpecConfig(strategy=DraftStrategy.none)))
        span["end"] = time.perf_counter()
        span["steps_after"] = len(ex.history)

    threads = [threading.Thread(target=long_prompt)] + [threading.Thread(target=chat, args=(s,))
                                                         for s in range(args.streams)]
    for t in threads:
        t.start()
    threads[0].join()
    time.sleep(1.0)
    stop.set()
    for t in threads[1:]:
        t.join()

    t0, t1 = span["start"], span["end"]
    outside, during = [], []
    arrivals.sort(key=lambda a: (a[1][0], a[0]))  # each stream's steps in time order
    for (ta, ra), (tb, rb) in zip(arrivals, arrivals[1:]):
        if ra == rb:  # gaps inside one request's stream
            (during if t0 <= ta and tb <= t1 else outside).append((tb - ta) * 1e3)
    history = list(ex.history)
    calm = [s * 1e3 for rows, pieces, s in history[: span["steps_before"]] if rows and not pieces]
    steps = history[span["steps_before"]: span["steps_after"]]
    with_rows = [(sum(p), s * 1e3) for rows, p, s in steps if rows and p]
    alone = [(sum(p), s * 1e3) for rows, p, s in steps if p and not rows]

    def summary(xs: list[float]) -> dict:
        return {"n": len(xs), "p50_ms": pct(xs, 0.5), "p99_ms": pct(xs, 0.99), "max_ms": max(xs) if xs else None}

    report = {
        "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "min_piece": args.min_piece, "cost_factor": args.cost_factor, "streams": args.streams,
        "precision": core.engine.runner.precision, "split_layers": getattr(ex, "split_layers", 0),
        "long_prompt_tokens": len(long_ids), "long_prefill_s": t1 - t0,
        "gaps_outside": summary(outside), "gaps_during": summary(during),
        "decode_steps_before": summary(calm),
        "steps_rows_and_piece": {**summary([s for _, s in with_rows]),
                                 "piece_tokens_p50": statistics.median(n for n, _ in with_rows) if with_rows else None},
        "steps_piece_alone": {**summary([s for _, s in alone]), "seconds": sum(s for _, s in alone) / 1e3,
                              "piece_tokens_p50": statistics.median(n for n, _ in alone) if alone else None},
    }
    # the steps of the prefill, for a closer look: (decoding rows, piece tokens, ms)
    report["prefill_steps"] = [(len(rows) if hasattr(rows, "__len__") else rows, sum(p), round(s * 1e3, 2))
                               for rows, p, s in steps]
    print(json.dumps({k: v for k, v in report.items() if k != "prefill_steps"}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
