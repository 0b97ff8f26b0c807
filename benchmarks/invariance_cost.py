#!/usr/bin/env python
"""What batch invariance costs a float32 target on this CPU: a one-token step, a 9-token block and a
300-token prefill at 300 tokens of context under `--gemm invariant` (the default: one row-invariant
kernel of ours for every GEMM) and `--gemm auto` (the fastest library path per shape and row count),
both models built in one process and timed alternately, so host drift falls on both alike. Medians
of 5 rounds (each step the median of 8). Nothing else CPU-heavy may run meanwhile.

    .venv/bin/python benchmarks/invariance_cost.py --out docs/results/determinism/f32_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tandem.engine.model import gemm
from tandem.engine.model.llama import NativeLlama
from tandem.engine.model.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, progress=False, precision="float32")
    models = {}
    for mode in (gemm.INVARIANT, "auto"):
        gemm.GemmSettings.configure(mode, progress=False)
        models[mode] = NativeLlama(loaded.model)
    gemm.GemmSettings.configure(gemm.INVARIANT)
    ctx = list(range(1000, 1300))
    times = {m: {"decode_1": [], "block_9": [], "prefill_300": []} for m in models}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for mode, m in models.items():
                cache = m.new_cache()
                t = time.perf_counter()
                m.forward(ctx, cache, all_logits=False)
                times[mode]["prefill_300"].append(time.perf_counter() - t)
                for name, n in (("decode_1", 1), ("block_9", 9)):
                    each = []
                    for _ in range(8):
                        t = time.perf_counter()
                        m.forward(list(range(2000, 2000 + n)), cache)
                        each.append(time.perf_counter() - t)
                        cache.crop_to(len(ctx))
                    times[mode][name].append(statistics.median(each))
    report = {"cpu": gemm.cpu_model(), "threads": torch.get_num_threads(), "model": loaded.model_id,
              "batch_invariant": {mode: m.batch_invariant for mode, m in models.items()},
              "invariant_path": getattr(gemm.invariant_path(), "value", None),
              "ms": {mode: {k: round(statistics.median(v) * 1e3, 2) for k, v in t.items()} for mode, t in times.items()}}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
