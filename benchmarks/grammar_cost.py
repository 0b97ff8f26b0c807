#!/usr/bin/env python
"""What the grammar costs per verification step: Constraint.prepare (walk the drafts, fill every
position's mask) plus Constraint.mask (apply it to the [k+1, vocab] logits) on SmolLM2's vocabulary,
for plain steps (k = 0) and blocks of 4 and 8 drafts.

    .venv/bin/python benchmarks/grammar_cost.py
"""
import json, time, statistics, torch
from tandem.contract.params import Grammar
from tandem.engine.model.tokenizer import load_tokenizer
from tandem.engine.speculation.draft import Draft
from tandem.engine.speculation.grammar import Constraint
_, tok, _ = load_tokenizer("default")
V = len(tok)
text = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"], "city": "London"})
ids = tok(text, add_special_tokens=False)["input_ids"]
for k in (0, 4, 8):
    c = Constraint(Grammar(kind="json_object"), tok, V, [2])
    times = []
    for i in range(len(ids) - k - 1):
        draft = Draft(tokens=ids[i:i + k], proposer="x") if k else None
        logits = torch.randn(k + 1, V)
        t = time.perf_counter()
        d, bm = c.prepare(draft)
        masked = c.mask(logits, bm)
        times.append(time.perf_counter() - t)
        c.advance([ids[i]])
    print(f"k={k}: grammar work per step median {statistics.median(times)*1e6:.0f} us, mean {statistics.mean(times)*1e6:.0f} us")
