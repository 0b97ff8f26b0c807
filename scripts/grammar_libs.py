#!/usr/bin/env python
"""Which constrained-decoding library for structured output: xgrammar against llguidance on the
embedded SmolLM2's tokenizer, over a JSON schema and a 32-token output, measuring setup + compile
time and the token mask's cost per position (the part that runs on every verified position).

    .venv/bin/python scripts/grammar_libs.py      (needs: pip install llguidance)
"""
import json, time, statistics, torch
from tandem.engine.models import load_tokenizer
_, tok, _ = load_tokenizer("default")
V = len(tok)
schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"],
          "additionalProperties": False}
text = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"]})
ids = tok(text, add_special_tokens=False)["input_ids"]
print("vocab", V, "tokens", len(ids))
import xgrammar as xgr
t = time.perf_counter()
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
comp = xgr.GrammarCompiler(info)
g = comp.compile_json_schema(json.dumps(schema))
print("xgrammar init+compile s", round(time.perf_counter() - t, 3))
m = xgr.GrammarMatcher(g)
bm = xgr.allocate_token_bitmask(1, V)
times = []
for x in ids:
    t = time.perf_counter(); m.fill_next_token_bitmask(bm); times.append(time.perf_counter() - t)
    assert m.accept_token(x), x
print("xgrammar mask us median", round(statistics.median(times) * 1e6), "mean", round(statistics.mean(times) * 1e6))
import llguidance, llguidance.hf, llguidance.torch
t = time.perf_counter()
lt = llguidance.hf.from_tokenizer(tok)
gr = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
lm = llguidance.LLMatcher(lt, gr)
print("llguidance init+compile s", round(time.perf_counter() - t, 3), lm.get_error())
bm2 = llguidance.torch.allocate_token_bitmask(1, lt.vocab_size)
times = []
for x in ids:
    t = time.perf_counter(); llguidance.torch.fill_next_token_bitmask(lm, bm2, 0); times.append(time.perf_counter() - t)
    assert lm.consume_token(x), (x, lm.get_error())
print("llguidance mask us median", round(statistics.median(times) * 1e6), "mean", round(statistics.mean(times) * 1e6))
