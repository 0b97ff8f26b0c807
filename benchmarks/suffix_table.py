"""Markdown tables of suffix decoding's benchmark records (benchmarks/suffix_bench.sh writes them):
per prompt set, each mode's speedup over plain decoding in the same run (median over prompts),
acceptance, tokens per target forward and lossless count; warm and cold side by side.

    python benchmarks/suffix_table.py DIR [MODES]   # MODES: comma-separated columns (default: ORDER)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ORDER = ["ngram", "suffix", "model", "hybrid-nosuffix", "hybrid"]


def load(directory: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def cell(mode: dict) -> str:
    acc = mode.get("acceptance_rate")
    return (f"{mode['speedup_vs_ar']:.2f}x ({'-' if acc is None else f'{acc:.0%}'}, "
            f"{mode['mean_accepted_len']:.2f})")


def table(records: dict[str, dict]) -> str:
    """Median speedup per mode; modes a record did not run stay empty."""
    rows = ["| run | plain tok/s | " + " | ".join(ORDER) + " | lossless |",
            "|---|---:|" + "---:|" * len(ORDER) + "---:|"]
    for name, rec in records.items():
        modes = rec["modes"]
        cells = [cell(modes[m]) if m in modes else "" for m in ORDER]
        n = len(rec["prompts"])
        lossless = min(round(modes[m]["lossless"] * n) for m in modes if modes[m].get("lossless") is not None)
        rows.append(f"| {name} | {modes['ar']['tokens_per_s']:.1f} | " + " | ".join(cells) + f" | {lossless}/{n} |")
    return "\n".join(rows)


def totals(records: dict[str, dict]) -> str:
    """The whole run's plain-decoding time over each mode's (every prompt's tokens together), and on
    how many prompts each mode beat prompt lookup."""
    rows = ["| run | " + " | ".join(ORDER) + " | suffix faster than ngram on |",
            "|---|" + "---:|" * len(ORDER) + "---:|"]
    for name, rec in records.items():
        modes = rec["modes"]
        ar = modes["ar"]["seconds"]
        cells = [f"{ar / modes[m]['seconds']:.2f}x" if m in modes else "" for m in ORDER]
        prompts = rec["prompts"]
        faster = sum(p["modes"]["suffix"]["seconds"] < p["modes"]["ngram"]["seconds"] for p in prompts
                     if "ngram" in p["modes"])
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {faster}/{len(prompts)} prompts |")
    return "\n".join(rows)


def main() -> None:
    global ORDER
    directory = Path(sys.argv[1])
    if len(sys.argv) > 2:
        ORDER = [m for m in sys.argv[2].split(",") if m]
    records = load(directory)
    if not records:
        raise SystemExit(f"no records in {directory}")
    cpu = records[next(iter(records))]["config"]["machine"].get("cpu", "?")
    print(f"CPU: {cpu}; cells: speedup over plain decoding (acceptance, tokens per target forward)\n")
    print(table(records))
    print("\nWhole-run time ratio (plain decoding's total time / the mode's), and per prompt:\n")
    print(totals(records))
    print()
    for name, rec in records.items():
        store = rec["config"].get("suffix_store")
        end = rec["config"].get("suffix_store_end")
        print(f"- {name}: {rec['config']['date']}, {len(rec['prompts'])} prompts, store {store}"
              + (f" (at the end: {end['responses']} answers, {end['tokens']} tokens)" if end else ""))
        trees = [f"{m} {mode['tree_steps']} of {mode['steps']} steps ({mode['tree_off_path']} off the first path)"
                 for m, mode in rec["modes"].items() if mode.get("tree_steps") is not None and "steps" in mode]
        if trees:
            print("  branching trees verified: " + "; ".join(trees))


if __name__ == "__main__":
    main()
