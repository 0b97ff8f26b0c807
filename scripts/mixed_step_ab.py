#!/usr/bin/env python
"""A forward carrying decoding rows beside a prompt piece, on the default target: one process per
build (run it in each checkout, nothing else running). docs/results/intel-gguf/mixed-fused/."""
import time, statistics, torch, sys
from tandem.engine.models import load_model
from tandem.engine.llama import NativeLlama
torch.set_num_threads(2)
lm = load_model(progress=False)
nat = NativeLlama(lm.model, quantized=lm.quantized)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, nat.vocab, (3000,), generator=g).tolist()
caches = []
for i in range(64):
    c = nat.new_cache(400); nat.forward(ids[i:i+200], c, all_logits=False); caches.append(c)
pc = nat.new_cache(3000); nat.forward(ids[:1000], pc, all_logits=False)
def step(rows, piece):
    for c in caches: c.length = 200
    pc.length = 1000
    blocks = [([ids[300 + i]], c) for i, c in zip(range(rows), caches)]
    need = [True] * rows
    if piece:
        blocks.append((ids[1000:1000+piece], pc)); need.append(False)
    nat.forward_batch(blocks, need)
out = {}
for rows, piece in ((1, 0), (1, 64), (1, 256), (8, 0), (8, 256), (64, 0), (64, 64), (64, 256)):
    step(rows, piece)
    ts = []
    for _ in range(7):
        t = time.perf_counter(); step(rows, piece); ts.append(time.perf_counter() - t)
    print(f"{rows} decode rows + a {piece}-token piece (at 1,000 tokens): {statistics.median(ts)*1e3:.1f} ms", flush=True)
