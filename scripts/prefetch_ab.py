#!/usr/bin/env python
"""Software prefetch in quant.c and attend.c: this checkout's kernels against the same two files at
an older commit (before the prefetch), alternated in one process on the default target: one-token
and nine-token steps at 300 and 4,000 tokens of context, the median of several alternations. Only the
two kernels are swapped; everything else is the same code. Nothing else may run meanwhile.

    .venv/bin/python scripts/prefetch_ab.py OLD_COMMIT docs/results/<host>/prefetch/ab.json
"""
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tandem.engine import attend, gemv, quant
from tandem.engine.gemm import cpu_model, median_seconds
from tandem.engine.llama import NativeLlama
from tandem.engine.models import load_model

old_commit, out_path = sys.argv[1], sys.argv[2]
torch.set_num_threads(2)
tmp = Path(tempfile.mkdtemp())
old = {}
for name, bind in (("quant", quant._bind), ("attend", attend._bind)):
    src = tmp / f"{name}_old.c"
    src.write_text(subprocess.run(["git", "show", f"{old_commit}:tandem/engine/{name}.c"], capture_output=True,
                                  text=True, check=True).stdout)
    old[name] = gemv.build(src, f"{name} at {old_commit}")
    bind(old[name])
new = {"quant": quant.library(), "attend": attend.library()}

lm = load_model(progress=False)
nat = NativeLlama(lm.model, quantized=lm.quantized)
weights = [layer[key] for layer in nat.layers for key in ("wqkv", "wo", "wgu", "wdown")] + list(nat.head_chunks)
names = [w._fn.__name__ for w in weights]


def use(libs: dict) -> None:
    for w, fn in zip(weights, names):
        w._fn = getattr(libs["quant"], fn)
    attend._kernel._lib = libs["attend"]  # _FusedAttention asks for it per forward


print(cpu_model(), nat.precision, flush=True)
result = {"cpu": cpu_model(), "old_commit": old_commit, "threads": 2, "steps": {}}
for ctx in (300, 4000):
    ids = torch.randint(0, nat.vocab, (ctx + 20,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = nat.new_cache(ctx + 20)
    nat.forward(ids[:ctx], cache, all_logits=False)
    for n in (1, 9):
        times = {"old": [], "new": []}
        for rep in range(6):
            for label, libs in (("old", old), ("new", new)):
                use(libs)

                def step():
                    cache.length = ctx
                    nat.forward(ids[ctx : ctx + n], cache)

                times[label].append(median_seconds(step, 15) * 1e3)
        a, b = statistics.median(times["old"]), statistics.median(times["new"])
        result["steps"][f"{ctx}/{n}"] = {"old_ms": round(a, 2), "new_ms": round(b, 2), "ratio": round(b / a, 3)}
        print(f"context {ctx}, {n} token(s): old {a:.2f} ms, new {b:.2f} ms, new/old {b / a:.3f}", flush=True)
use(new)
Path(out_path).parent.mkdir(parents=True, exist_ok=True)
Path(out_path).write_text(json.dumps(result, indent=1))
