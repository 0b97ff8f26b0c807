#!/usr/bin/env python
"""The default target's forward with a float16 KV cache against a float32 one, alternated in one
process (the same weights, the same kernels; only the cache type differs): a one-token step and a
4-token verification block at several contexts, and a batched 16-session one-token step at 300
tokens each. Medians of repeated forwards, ms. Nothing else CPU-heavy may run meanwhile.

    .venv/bin/python scripts/kv_dtype_ab.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.engine.gemm import cpu_model  # noqa: E402
from tandem.engine.llama import NativeLlama  # noqa: E402
from tandem.engine.models import load_model  # noqa: E402
from rich.progress import track  # noqa: E402


def _filled(nat: NativeLlama, ids: list[int], n: int):
    cache = nat.new_cache()
    for at in range(0, n, 256):
        nat.forward_batch([(ids[at : min(n, at + 256)], cache)], [False])
    return cache


def _median_ms(run, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="300,2000,4000,7000")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two caches")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lm = load_model()
    models = {str(dt).replace("torch.", ""): NativeLlama(lm.model, quantized=lm.quantized, kv_dtype=dt)
              for dt in (torch.float32, torch.float16)}
    ids = (lm.tokenizer("The quick brown fox jumps over the lazy dog. ")["input_ids"] * 800)[:8000]
    results: dict[str, dict[str, list[float]]] = {name: {} for name in models}
    cases = [(f"1 token at {c}", c, 1, 1) for c in map(int, args.contexts.split(","))]
    cases += [(f"4 tokens at {c}", c, 4, 1) for c in map(int, args.contexts.split(","))]
    cases += [("16 sessions x 1 token at 300", 300, 1, 16)]
    for _ in track(range(args.rounds), description="rounds"):
        for name, nat in models.items():
            for label, ctx, n, sessions in cases:
                caches = [_filled(nat, ids, ctx) for _ in range(sessions)]

                def step() -> None:
                    nat.forward_batch([(ids[ctx : ctx + n], c) for c in caches])
                    for c in caches:
                        c.crop_to(ctx)

                step()  # warm
                results[name].setdefault(label, []).append(_median_ms(step, 10))
    table = {name: {label: statistics.median(v) for label, v in res.items()} for name, res in results.items()}
    report = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "threads": torch.get_num_threads(), "precision": models["float16"].precision,
              "median_ms": table, "rounds_ms": results}
    print(f"{'case':<32}{'float32 KV':>12}{'float16 KV':>12}{'ratio':>8}")
    for label, *_ in cases:
        a, b = table["float32"][label], table["float16"][label]
        print(f"{label:<32}{a:>12.2f}{b:>12.2f}{b / a:>8.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
