#!/usr/bin/env python
"""What mutual TLS costs: two local stacks on the embedded default model, one plaintext and one
with `tandem up --tls` (mTLS gateway -> verifier -> drafter, HTTPS / gRPC TLS at the gateway, an
API key), both up at once and idle but for the request in flight, so each prompt runs on both
back to back in alternating order (like for like on a noisy host). Every request goes through the
gateway's gRPC Generate, greedy, one-off (no session), in modes ar (plain decoding) and ngram.

Reports per mode the median over prompts of the per-token time ratio TLS / plaintext, tokens/s of
each, time to first token, and whether every output is identical token for token across the two
stacks (TLS must change nothing but time).

    .venv/bin/python benchmarks/bench_tls.py [--dataset humaneval] [--limit 10] [--max-new-tokens 64]

Writes docs/results/<cpu>/tls_overhead.json (and prints a table). Run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.contract.params import SamplingParams  # noqa: E402
from tandem.engine.native.build import cpu_model  # noqa: E402
from tandem.tools.bench_remote import GatewayTarget  # noqa: E402
from tandem.tools.datasets import load_prompts, resolve_dataset  # noqa: E402
from tandem.tools.records import host_label, write_record  # noqa: E402
from tandem.tools.stack import Stack, StackConfig, free_port  # noqa: E402

KEY = "sk-bench-tls-0123456789abcdef"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from rich.progress import track

    records = load_prompts(resolve_dataset(args.dataset), args.limit)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        keys.write_text(json.dumps({"tenants": {"bench": {"keys": [KEY]}}}))
        common = dict(verifier_threads=1, log_level="warning", metrics=False)
        plain = Stack(StackConfig(http_port=free_port(), grpc_port=free_port(), **common))
        tls = Stack(StackConfig(http_port=free_port(), grpc_port=free_port(), tls_dir=Path(tmp) / "certs",
                                api_keys_file=keys, **common))
        plain.start()
        try:
            tls.start()
            try:
                targets = {"plain": GatewayTarget(plain.grpc_address),
                           "tls": GatewayTarget(f"localhost:{tls.config.grpc_port}", ca=tls.ca, api_key=KEY)}
                rows = []
                for i, rec in enumerate(track(records, description="prompts (plain and TLS, alternating)")):
                    for mode in ("ar", "ngram"):
                        order = ("plain", "tls") if i % 2 == 0 else ("tls", "plain")
                        row = {"id": rec.id, "mode": mode}
                        for name in order:
                            t = targets[name]
                            ctx, _ = t.prepare(rec)
                            t.generate(ctx, sampling.model_copy(update={"max_new_tokens": 4}), mode)  # warm channel
                            res = t.generate(ctx, sampling, mode)
                            row[name] = {"seconds": res.seconds, "tokens": res.token_ids,
                                         "first_token_s": res.first_token_seconds}
                        rows.append(row)
            finally:
                tls.stop()
        finally:
            plain.stop()

    summary = {}
    for mode in ("ar", "ngram"):
        rs = [r for r in rows if r["mode"] == mode]
        ratio = [(r["tls"]["seconds"] / max(1, len(r["tls"]["tokens"])))
                 / (r["plain"]["seconds"] / max(1, len(r["plain"]["tokens"]))) for r in rs]
        tps = {k: statistics.median(len(r[k]["tokens"]) / r[k]["seconds"] for r in rs) for k in ("plain", "tls")}
        ttft = {k: statistics.median(r[k]["first_token_s"] for r in rs) for k in ("plain", "tls")}
        summary[mode] = {
            "prompts": len(rs),
            "time_per_token_ratio_tls_over_plain": {"median": statistics.median(ratio), "min": min(ratio),
                                                    "max": max(ratio)},
            "tokens_per_s": tps,
            "first_token_s": ttft,
            "identical_outputs": sum(r["tls"]["tokens"] == r["plain"]["tokens"] for r in rs),
        }
    cpu = cpu_model()
    report = {"cpu": cpu, "dataset": args.dataset, "max_new_tokens": args.max_new_tokens, "summary": summary,
              "prompts": [{**r, "plain": {**r["plain"], "tokens": len(r["plain"]["tokens"])},
                           "tls": {**r["tls"], "tokens": len(r["tls"]["tokens"])}} for r in rows]}
    out = write_record(args.out or ROOT / "docs" / "results" / host_label(cpu) / "tls_overhead.json", report)
    print(f"CPU: {cpu}; {args.dataset}, {len(records)} prompts, {args.max_new_tokens} tokens, greedy, through the gateway")
    print("| mode | time/token TLS / plain (median, range) | tok/s plain | tok/s TLS | first token plain / TLS | identical |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, s in summary.items():
        r = s["time_per_token_ratio_tls_over_plain"]
        print(f"| {mode} | {r['median']:.3f} ({r['min']:.2f}-{r['max']:.2f}) | {s['tokens_per_s']['plain']:.1f} | "
              f"{s['tokens_per_s']['tls']:.1f} | {s['first_token_s']['plain'] * 1000:.0f} / "
              f"{s['first_token_s']['tls'] * 1000:.0f} ms | {s['identical_outputs']}/{s['prompts']} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
