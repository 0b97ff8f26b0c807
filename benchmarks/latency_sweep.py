#!/usr/bin/env python
"""The distributed premise, measured: speculation's speedup over plain decoding through the gateway
as the drafter-verifier round trip grows, with each service on a network host of its own.

Valkey, drafter, verifier and gateway run in separate network namespaces (tandem/tools/netns.py);
the drafter-verifier link gets a round trip of 0, 1, 5 and 20 ms (jitter: a tenth of it) from the
delaying proxy on it. At every delay, `tandem bench` through the gateway runs plain decoding (ar),
prompt lookup (ngram) and the hybrid (prompt lookup + the distilled draft model on the drafter),
interleaved per prompt, on the same deployment: ratios are against plain decoding of the same run.
The whole sweep runs twice, draft-ahead on (`tandem drafter`, default) and off (`--no-lookahead`).

    sudo .venv/bin/python benchmarks/latency_sweep.py [--limit 8] [--max-new-tokens 64]

Results: docs/results/<cpu>/latency_sweep.json and latency_sweep.png (ratio against round trip).
Needs root (namespaces), the default model and its distilled draft (`make draft`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.engine.native.build import cpu_model  # noqa: E402
from tandem.tools.bench import run_bench  # noqa: E402
from tandem.tools.bench_remote import GatewayTarget  # noqa: E402
from tandem.tools.datasets import dev_set, load_prompts  # noqa: E402
from tandem.tools.stack import Stack, StackConfig  # noqa: E402

RTTS_MS = (0, 1, 5, 20)
MODES = ("ar", "ngram", "hybrid")


def sweep(lookahead: bool, records, max_new: int, draft: str, log) -> list[dict]:
    from tandem.tools.netns import NetnsTopology

    topo = NetnsTopology(verifiers=1)
    cfg = StackConfig(draft_model=draft, log_level="warning", metrics=False, topology=topo,
                      drafter_args=() if lookahead else ("--no-lookahead",))
    rows = []
    with Stack(cfg) as stack:
        target = GatewayTarget(stack.grpc_address)
        # One warm-up pass: the first requests pay for lazy initialisation on every tier.
        run_bench(target, records[:1], list(MODES), 16, progress=False)
        for rtt in RTTS_MS:
            topo.links["drafter"].set_delay(rtt, jitter_ms=rtt / 10)
            started = time.monotonic()
            result = run_bench(target, records, list(MODES), max_new, progress=False)
            row = {"lookahead": lookahead, "rtt_ms": rtt, "seconds": round(time.monotonic() - started, 1)}
            for mode in MODES[1:]:
                m = result["modes"][mode]
                row[mode] = {"speedup_vs_ar": m["speedup_vs_ar"], "lossless": m["lossless"],
                             "acceptance_rate": m.get("acceptance_rate"),
                             "mean_accepted_len": m.get("mean_accepted_len"),
                             "drafted_per_reply": m.get("drafted_per_reply")}
            row["ar_tokens_per_s"] = result["modes"]["ar"].get("tokens_per_s")
            rows.append(row)
            log(f"draft-ahead {'on ' if lookahead else 'off'} rtt {rtt:>2} ms: " + ", ".join(
                f"{mode} {row[mode]['speedup_vs_ar']:.2f}x (lossless {row[mode]['lossless']:.0%})"
                for mode in MODES[1:]))
    return rows


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for lookahead, style in ((True, "-"), (False, "--")):
        for mode, colour in (("ngram", "tab:blue"), ("hybrid", "tab:orange")):
            rows = [r for r in data["rows"] if r["lookahead"] == lookahead]
            ax.plot([r["rtt_ms"] for r in rows], [r[mode]["speedup_vs_ar"] for r in rows], style, marker="o",
                    color=colour, label=f"{mode}, draft-ahead {'on' if lookahead else 'off'}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(list(RTTS_MS), [str(r) for r in RTTS_MS])
    ax.set_xlabel("drafter-verifier round trip (ms)")
    ax.set_ylabel("speedup over plain decoding (median)")
    ax.set_title(f"Speculation across network hosts ({data['config']['cpu']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="humaneval", help="dev set name (tandem.tools.datasets.DEV_SETS)")
    ap.add_argument("--limit", type=int, default=8, help="prompts per delay and mode")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="results directory (default docs/results/<cpu>)")
    args = ap.parse_args()
    from tandem.engine.model.paths import find_default_draft, resolve_model_path

    draft = find_default_draft(resolve_model_path("default")[0])
    if draft is None:
        print("no distilled draft for the default model: run `make draft` first", file=sys.stderr)
        return 2
    cpu = cpu_model()
    out = args.out or ROOT / "docs" / "results" / ("intel" if "Intel" in cpu else "amd" if "AMD" in cpu else "other")
    out.mkdir(parents=True, exist_ok=True)
    records = load_prompts(dev_set(args.dataset), args.limit)
    os.environ.pop("TANDEM_REDIS_URL", None)
    data = {"config": {"cpu": cpu, "dataset": args.dataset, "prompts": len(records), "max_new_tokens": args.max_new_tokens,
                       "rtts_ms": list(RTTS_MS), "jitter": "rtt / 10", "modes": list(MODES),
                       "gateway_verifier_rtt_ms": 0, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "command": "benchmarks/latency_sweep.py " + " ".join(sys.argv[1:])},
            "rows": []}
    for lookahead in (True, False):
        data["rows"] += sweep(lookahead, records, args.max_new_tokens, str(draft), lambda s: print(s, flush=True))
        (out / "latency_sweep.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(data, out / "latency_sweep.png")
    print(f"wrote {out / 'latency_sweep.json'} and latency_sweep.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
