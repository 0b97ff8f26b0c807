#!/usr/bin/env python
"""Tool-calling accuracy on the BFCL dev sets (bundled in tandem/tools/prompts/bfcl), with and without speculation,
through a local stack (`tandem up`: Valkey, drafter, verifier, gateway) and the official `openai`
client: each question is asked with its functions as `tools` and `tool_choice: "required"` (the
call grammar is active), greedy, in modes none / ngram / hybrid (hybrid when the distilled draft
exists). Scored as BFCL scores it, by AST match against possible_answer/: the function name, every
required argument present, no argument the function lacks, each given value among the allowed
ones ("" in the allowed list = may be left out).

Reports per mode: accuracy, whether every call equals plain decoding's, and the median per-token
time ratio against plain decoding of the same question.

    .venv/bin/python scripts/bfcl_eval.py [--set multiple] [--limit 20] [--out docs/results/epyc/bfcl_tools.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.engine.native.build import cpu_model  # noqa: E402
from tandem.tools.datasets import bfcl_schema  # noqa: E402
from tandem.tools.records import host_label, write_record  # noqa: E402
from tandem.tools.stack import Stack, StackConfig, free_port  # noqa: E402

DATA = ROOT / "tandem" / "tools" / "prompts" / "bfcl"  # the bundled BFCL sets (prompts/PROVENANCE.md)
_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None, "list": "array", "int": "integer",
          "str": "string", "bool": "boolean"}


def to_json_schema(node):
    """BFCL's parameter types (dict, float, tuple, any) as JSON Schema, without the annotations
    (description, default, optional) that its grammar does not need."""
    return bfcl_schema(node, _TYPES, drop=("description", "default", "optional"))


def load(name: str, limit: int) -> list[tuple[dict, dict]]:
    questions = [json.loads(line) for line in (DATA / f"BFCL_v4_{name}.json").read_text().splitlines() if line.strip()]
    answers = {a["id"]: a for a in (json.loads(line) for line in
                                      (DATA / "possible_answer" / f"BFCL_v4_{name}.json").read_text().splitlines()
                                      if line.strip())}
    return [(q, answers[q["id"]]) for q in questions[:limit]]


def ast_match(name: str, args: dict, question: dict, answer: dict) -> bool:
    truth = answer["ground_truth"][0]
    if name not in truth:
        return False
    allowed = truth[name]
    fn = next(f for f in question["function"] if f["name"] == name)
    props = fn["parameters"].get("properties", {})
    if any(k not in props for k in args):
        return False
    for param, values in allowed.items():
        if param not in args:
            if "" not in values:
                return False
            continue
        v = args[param]
        ok = any(v == a or (isinstance(a, (int, float)) and isinstance(v, (int, float)) and float(v) == float(a))
                 or (isinstance(a, str) and isinstance(v, str) and v.strip().lower() == a.strip().lower())
                 for a in values if a != "")
        if not ok:
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="multiple", choices=["multiple", "simple_python"])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import openai
    from rich.progress import track

    from tandem.engine.model.paths import ModelError, find_default_draft, resolve_model_path

    try:
        draft = find_default_draft(resolve_model_path("default")[0])
    except ModelError:
        draft = None
    modes = ["none", "ngram"] + (["hybrid"] if draft else [])
    items = load(args.set, args.limit)
    stack = Stack(StackConfig(http_port=free_port(), grpc_port=free_port(), log_level="warning", metrics=False,
                              draft_model=str(draft) if draft else None))
    stack.start()
    rows = []
    try:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=300)
        for q, a in track(items, description=f"BFCL {args.set}"):
            tools = [{"type": "function", "function": {"name": f["name"], "description": f.get("description", ""),
                                                       "parameters": to_json_schema(f["parameters"])}}
                     for f in q["function"]]
            row = {"id": q["id"], "modes": {}}
            for mode in modes:
                start = time.perf_counter()
                reply = client.chat.completions.create(
                    model="default", messages=q["question"][0], tools=tools, tool_choice="required",
                    max_tokens=args.max_tokens, temperature=0,
                    extra_body={"speculation": {"strategy": mode}})
                seconds = time.perf_counter() - start
                calls = reply.choices[0].message.tool_calls or []
                name, call_args = (calls[0].function.name, json.loads(calls[0].function.arguments)) if calls else ("", {})
                spec = reply.usage.model_extra["speculation"]
                row["modes"][mode] = {"name": name, "arguments": call_args, "correct": bool(calls) and ast_match(name, call_args, q, a),
                                      "seconds": seconds, "tokens": reply.usage.completion_tokens,
                                      "drafted": spec["drafted"], "accepted": spec["accepted"], "steps": spec["steps"]}
            rows.append(row)
    finally:
        stack.stop()
    summary = {}
    for mode in modes:
        ms = [r["modes"][mode] for r in rows]
        ratio = [(r["modes"]["none"]["seconds"] / max(1, r["modes"]["none"]["tokens"]))
                 / (r["modes"][mode]["seconds"] / max(1, r["modes"][mode]["tokens"])) for r in rows]
        summary[mode] = {
            "accuracy": sum(m["correct"] for m in ms) / len(ms),
            "identical_to_none": sum((m["name"], m["arguments"]) == (r["modes"]["none"]["name"], r["modes"]["none"]["arguments"])
                                     for m, r in zip(ms, rows)),
            "speedup_vs_none": statistics.median(ratio),
            "tokens_per_step": sum(m["tokens"] for m in ms) / max(1, sum(m["steps"] for m in ms)),
        }
    cpu = cpu_model()
    report = {"cpu": cpu, "set": args.set, "questions": len(rows), "max_tokens": args.max_tokens, "summary": summary,
              "rows": rows}
    out = write_record(args.out or ROOT / "docs" / "results" / host_label(cpu) / f"bfcl_tools_{args.set}.json", report)
    print(f"CPU: {cpu}; BFCL {args.set}, {len(rows)} questions, tool_choice required (grammar on), greedy, through the stack")
    print("| mode | accuracy (AST match) | calls identical to plain decoding | speedup vs plain (median) | tokens per step |")
    print("|---|---:|---:|---:|---:|")
    for mode, s in summary.items():
        print(f"| {mode} | {s['accuracy']:.2f} | {s['identical_to_none']}/{len(rows)} | {s['speedup_vs_none']:.2f}x | "
              f"{s['tokens_per_step']:.2f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
