#!/usr/bin/env python
"""The raw layer calls (llama._RawLayers) against the checked path on the default target, alternated
in one process: one-token and nine-token steps at 300 and 4,000 tokens of context. Nothing else may
run meanwhile.

    .venv/bin/python scripts/raw_layers_ab.py docs/results/<host>/raw-layers/ab.json
"""
import json
import statistics
import sys

import torch
from tandem.engine.models import load_model
from tandem.engine.llama import NativeLlama
from tandem.engine.gemm import median_seconds, cpu_model
torch.set_num_threads(2)
lm = load_model(progress=False)
nat = NativeLlama(lm.model, quantized=lm.quantized)
print(cpu_model(), nat.precision, "raw available:", nat.raw_layers)
out = {}
for ctx in (300, 4000):
    ids = torch.randint(0, nat.vocab, (ctx+20,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = nat.new_cache(ctx+20)
    nat.forward(ids[:ctx], cache, all_logits=False)
    for n in (1, 9):
        res = {True: [], False: []}
        for rep in range(6):
            for raw in (False, True):
                nat.raw_layers = raw
                def step():
                    cache.length = ctx
                    nat.forward(ids[ctx:ctx+n], cache)
                res[raw].append(median_seconds(step, 15) * 1e3)
        a, b = statistics.median(res[False]), statistics.median(res[True])
        out[f"{ctx}/{n}"] = {"checked_ms": round(a, 2), "raw_ms": round(b, 2), "ratio": round(b / a, 3)}
        print(ctx, n, "checked %.2f ms raw %.2f ms ratio %.3f" % (a, b, b / a), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
