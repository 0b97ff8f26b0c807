#!/usr/bin/env python
"""A batched decode step's attention: one kernel call a layer for every session's block
(`tandem_attend_many`) against a call a block, alternated in one process on the default target
(the one-call path switched off by skipping its descriptors). One-token blocks of B sessions, each
over its own cache of `ctx` tokens; medians of 10-step medians over six alternations. Nothing else
may run meanwhile.

    .venv/bin/python scripts/attend_many_ab.py docs/results/<host>/attend-many/ab.json
"""
import sys, time, torch, statistics, json
torch.set_num_threads(2)
from tandem.engine import llama
from tandem.engine.gemm import cpu_model, median_seconds
from tandem.engine.llama import NativeLlama
from tandem.engine.models import load_model
lm = load_model(progress=False)
nat = NativeLlama(lm.model, quantized=lm.quantized)
real = llama._FusedAttention._describe
res = {"cpu": cpu_model(), "steps": {}}
for B, ctx in [(1, 300), (8, 300), (16, 300), (16, 1000), (64, 300)]:
    g = torch.Generator().manual_seed(0)
    caches, ids = [], []
    for b in range(B):
        i = torch.randint(0, nat.vocab, (ctx + 4,), generator=g).tolist()
        c = nat.new_cache(ctx + 8); nat.forward(i[:ctx], c, all_logits=False)
        caches.append(c); ids.append(i)
    def step():
        for c in caches: c.length = ctx
        nat.forward_batch([([i[ctx]], c) for i, c in zip(ids, caches)])
    t = {"per-block": [], "one call": []}
    for rep in range(6):
        for label in t:
            llama._FusedAttention._describe = real if label == "one call" else (lambda self: None)
            t[label].append(median_seconds(step, 10) * 1e3)
    a, b = statistics.median(t["per-block"]), statistics.median(t["one call"])
    res["steps"][f"{B}x{ctx}"] = {"per_block_ms": round(a, 2), "one_call_ms": round(b, 2)}
    print(f"{B} sessions at {ctx}: per-block {a:.2f} ms, one call {b:.2f} ms ({b/a:.3f})", flush=True)
llama._FusedAttention._describe = real
if len(sys.argv) > 1:
    open(sys.argv[1], "w").write(json.dumps(res, indent=1))
