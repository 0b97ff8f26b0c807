#!/usr/bin/env python
"""Regenerate docs/benchmarks.md: run `tandem bench` on the four dev sets, then write the tables and
plots from the JSON results.

    .venv/bin/python scripts/bench_docs.py --limit 20 --max-new-tokens 128 \\
        --modes ar,ngram,hf-ar,hf-prompt-lookup            # runs, writes docs/results/*.json, docs/...
    .venv/bin/python scripts/bench_docs.py --from-results  # only docs/benchmarks.md and its plots

Each set runs in its own `tandem bench` process (docs/results/<set>.json); the plots of all sets go to
docs/plots/*.png. In docs/benchmarks.md, the text between `<!-- reading -->` and `<!-- /reading -->`
(a person's reading of the numbers) and every block between `<!-- keep -->` and `<!-- /keep -->`
(the current tables written by hand: per workload, through the stack, peers, load) survive a
regeneration unchanged. The keep blocks open the page; the generated section closes it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tandem.tools.bench import median_speedup, speedup_cell  # noqa: E402
from tandem.tools.datasets import DEV_SETS, PROMPTS_DIR  # noqa: E402
from tandem.tools.plots import FILES, dataset_label, write_plots  # noqa: E402

DATA = PROMPTS_DIR
# (results name, file under DATA): the bundled dev sets (tandem/tools/prompts/PROVENANCE.md)
SETS = DEV_SETS
OURS = ("ar", "ngram", "model", "hybrid")
PEER = "hf-prompt-lookup"
READING = ("<!-- reading -->", "<!-- /reading -->")
KEEP = ("<!-- keep -->", "<!-- /keep -->")
READING_PLACEHOLDER = (
    "_Not written yet: replace this paragraph with an honest reading of the tables above (where Tandem "
    "wins and loses against the peer, and why, from the acceptance figures). It is kept when the page "
    "is regenerated._"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--limit", type=int, default=20, help="prompts per set (default 20)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per generation (default 128)")
    ap.add_argument("--modes", default="ar,ngram,hf-ar,hf-prompt-lookup", help="tandem bench --modes")
    ap.add_argument("--sets", default=",".join(n for n, _ in SETS),
                    help="comma-separated sets to run (the page shows every set with a result)")
    ap.add_argument("--from-results", action="store_true", help="do not run: regenerate the docs from the JSON")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results", help="directory of the JSON results (beside the page)")
    ap.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the page to regenerate")
    ap.add_argument("bench_args", nargs="*", help="more `tandem bench` options after --, e.g. -- --draft-model PATH")
    args = ap.parse_args(argv)

    names = [n.strip() for n in args.sets.split(",") if n.strip()]
    unknown = sorted(set(names) - {n for n, _ in SETS})
    if unknown:
        ap.error(f"unknown set(s) {unknown}; choose from {[n for n, _ in SETS]}")
    if not args.from_results:
        args.results.mkdir(parents=True, exist_ok=True)
        for name, file in SETS:
            if name in names:
                run_set(name, DATA / file, args)

    results = load_results(args.results, [n for n, _ in SETS])  # every set's latest run, not only these
    if not results:
        print(f"no results in {args.results}", file=sys.stderr)
        return 1
    plots_dir = args.docs.parent / "plots"
    for path in write_plots(results, plots_dir):
        print(f"wrote {path}", file=sys.stderr)
    old = args.docs.read_text(encoding="utf-8") if args.docs.exists() else ""
    args.docs.parent.mkdir(parents=True, exist_ok=True)
    args.docs.write_text(render(results, old, plots_rel=plots_dir.relative_to(args.docs.parent)), encoding="utf-8")
    print(f"wrote {args.docs}", file=sys.stderr)
    return 0


def run_set(name: str, path: Path, args) -> None:
    if not path.exists():
        raise SystemExit(f"{path} is missing from the bundled prompt sets")
    cmd = [
        sys.executable, "-m", "tandem.tools.cli", "bench", "--dataset", str(path), "--limit", str(args.limit),
        "--max-new-tokens", str(args.max_new_tokens), "--modes", args.modes,
        "--out", str(args.results / f"{name}.json"), *args.bench_args,
    ]
    print("$ " + " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, cwd=ROOT, check=True)


def load_results(directory: Path, names: list[str]) -> list[dict]:
    out = []
    for name, _ in SETS:
        path = directory / f"{name}.json"
        if name in names and path.exists():
            out.append(json.loads(path.read_text(encoding="utf-8")))
    return out


# --- the page -----------------------------------------------------------------------------------


def sections(text: str, markers: tuple[str, str]) -> list[str]:
    """The blocks of `text` between the markers, markers included, in order."""
    start, end = map(re.escape, markers)
    return re.findall(rf"{start}.*?{end}", text, flags=re.S)


def render(results: list[dict], old: str = "", *, plots_rel: Path | str = "plots") -> str:
    """docs/benchmarks.md from `results` (one `tandem bench` JSON per set), keeping the reading and
    the keep blocks of the `old` page."""
    cfg = results[0]["config"]
    reading = sections(old, READING)
    keeps = sections(old, KEEP)
    modes = list(dict.fromkeys(m for r in results for m in r["modes"]))
    machine = cfg.get("machine", {})
    dates = sorted({r["config"]["date"] for r in results})
    command = (
        f".venv/bin/python scripts/bench_docs.py --limit {cfg['limit']} --max-new-tokens {cfg['max_new_tokens']} "
        f"--modes {','.join(modes)}"
    )
    extra = bench_options(cfg)
    if extra:
        command += " -- " + " ".join(extra)
    temp = cfg["sampling"]["temperature"]
    decoding = "greedy" if not temp else f"sampling, temperature {temp}, seed {cfg['sampling']['seed']}"
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by scripts/bench_docs.py from docs/results/*.json. Edit only the text between the reading "
        "markers and blocks between keep markers: the rest is rewritten. -->",
        "",
    ]
    if keeps:
        lines += ["\n\n".join(keeps), ""]
    lines += [
        "## In process against Hugging Face transformers (generated)",
        "",
        "Regenerate this section (runs every set, then writes the tables and plots):",
        "",
        "```sh",
        command,
        ".venv/bin/python scripts/bench_docs.py --from-results   # only the page and plots, from docs/results/*.json",
        "```",
        "",
        f"- **Date**: {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1 else ""),
        f"- **Machine**: {machine.get('gpu') or machine.get('cpu', '?')}, {machine.get('cpu_count', '?')} cores, "
        f"{machine.get('torch_threads', '?')} torch threads, device {machine.get('device', '?')}; "
        f"{machine.get('platform', '?')}; Python {machine.get('python', '?')}, torch {machine.get('torch', '?')}",
        f"- **Model**: {cfg['model']}" + (f", draft model {cfg['draft_model']}" if cfg.get("draft_model") else ""),
        f"- **Run**: {decoding}, "
        f"up to {cfg['max_new_tokens']} new tokens, the first {cfg['limit']} prompts of each set, "
        f"{cfg.get('repeats', 1)} run(s) per prompt and mode, {cfg.get('turns', 1)} turn(s) per record",
        f"- **Modes**: {', '.join(modes)}. Ours: `ar` plain decoding, `ngram` prompt lookup, `model` a draft "
        "model, `hybrid` prompt lookup or the draft model per step (whichever is expected to commit more "
        "tokens per second). The peer: Hugging Face `transformers`' own `generate` on the same model object: `hf-ar` plain, "
        f"`hf-prompt-lookup` (`prompt_lookup_num_tokens={cfg.get('hf_lookup_tokens') or 10}`), `hf-assisted` "
        "(`assistant_model`). Every prompt runs in every mode in one process, interleaved, the order rotating.",
        "",
        "How to read the numbers: **speedup** is the median over prompts of the baseline's time per token "
        "divided by the mode's (ours against `ar`, the peer's against `hf-ar`); **vs hf-ar** is the same "
        "ratio against `hf-ar` for every mode, the like-for-like comparison with the peer; **accept** is "
        "the fraction of drafted tokens the target accepted, **tok/step** the tokens committed per target "
        "forward; **lossless** counts the prompts whose output equals the baseline's token for token "
        "(greedy). Times include the prefill. On a shared CPU only ratios measured side by side mean "
        "something (docs/design.md, \"Measuring\").",
        "",
        *curve_section(machine),
        "### Summary",
        "",
        *summary_table(results),
        "",
        f"Tandem vs {PEER}: the median over prompts of {PEER}'s time per token divided by that of Tandem's "
        "fastest mode on the set; above 1.00x Tandem is faster. Both ran in the same process, interleaved.",
        "",
        "### Reading",
        "",
        reading[0] if reading else f"{READING[0]}\n{READING_PLACEHOLDER}\n{READING[1]}",
        "",
        *draft_section(results),
        *first_prompts_section(results, 10),
        "### Per dataset",
        "",
    ]
    for r in results:
        lines += dataset_section(r)
    lines += ["### Plots", ""]
    titles = {
        "speedup.png": "Speedup by dataset and category",
        "acceptance_by_position.png": "Acceptance by draft position",
        "accepted_length.png": "Accepted-length histogram",
        "tokens_per_s.png": "Tokens/s over the prompt set",
    }
    for name in FILES:
        lines += [f"![{titles[name]}]({Path(plots_rel) / name})", ""]
    return "\n".join(lines).rstrip() + "\n"


def curve_section(machine: dict) -> list[str]:
    """The machine's cost curve, measured by `tandem bench` before the run (`tandem calibrate`)."""
    if "cost_curve" not in machine:
        return []
    from tandem.tools.calibrate import markdown_curve

    return [*markdown_curve(machine["cost_curve"]), ""]


def draft_section(results: list[dict]) -> list[str]:
    """The draft-model modes side by side per set, with the hybrid's choice between its proposers."""
    if not any("model" in r["modes"] or "hybrid" in r["modes"] for r in results):
        return []
    lines = [
        "### Draft model and hybrid",
        "",
        "Speedup over `ar` (tokens per target step in parentheses) of prompt lookup, the draft model alone "
        "and the hybrid; for the hybrid, the steps each proposer drafted and its acceptance.",
        "",
        "| dataset | ngram | model | hybrid | hybrid: ngram steps / accept | hybrid: model steps / accept | lossless (model, hybrid) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        n = r["config"]["limit"]
        modes = r["modes"]

        def cell(m: str) -> str:
            s = modes.get(m)
            if not s:
                return "-"
            return f"{speedup_cell(s)} ({_x(s['mean_accepted_len'], '{:.2f}')})"

        split = (modes.get("hybrid") or {}).get("by_proposer") or {}

        def share(name: str) -> str:
            c = split.get(name)
            return "-" if not c else f"{c['steps']} / {_x(c['acceptance_rate'], '{:.0%}')}"

        lossless = ", ".join(_count(modes[m]["lossless"], n) if m in modes else "-" for m in ("model", "hybrid"))
        lines.append(f"| {dataset_label(r)} | {cell('ngram')} | {cell('model')} | {cell('hybrid')} | "
                     f"{share('ngram')} | {share('model')} | {lossless} |")
    return lines + [""]


def first_prompts_section(results: list[dict], n: int) -> list[str]:
    """Speedups over only the first n prompts of each set (the core issue's `--limit 10` setting),
    recomputed from the per-prompt figures of the same run."""
    if not results or results[0]["config"]["limit"] <= n:
        return []
    ours = [m for m in OURS if m != "ar" and any(m in r["modes"] for r in results)]
    lines = [
        f"### The first {n} prompts of each set",
        "",
        f"The same run, medians over the first {n} prompts only (`tandem bench --limit {n}` runs exactly these).",
        "",
        "| dataset | " + " | ".join(ours) + " | lossless |",
        "|---|" + "---:|" * len(ours) + "---:|",
    ]
    for r in results:
        prompts = r["prompts"][:n]

        def timing(m: str):
            return [(p["modes"][m]["seconds"], p["modes"][m]["tokens"]) for p in prompts]

        cells = [_x(median_speedup(timing("ar"), timing(m))) if m in r["modes"] else "-" for m in ours]
        equal = all(p["modes"][m].get("equal_to_ar") for p in prompts for m in ours if m in r["modes"])
        lines.append(f"| {dataset_label(r)} | " + " | ".join(cells) + f" | {'all' if equal else 'NOT all'} |")
    return lines + [""]


def bench_options(cfg: dict) -> list[str]:
    """The `tandem bench` options a run's config shows it was given beyond the script's own."""
    machine = cfg.get("machine", {})
    out = []
    if cfg.get("draft_model") and not str(cfg["draft_model"]).endswith("-draft"):
        # the config names the draft model, not where it was loaded from; a `tandem distill` draft
        # of the target (named <target>-draft) is found without the option
        out += ["--draft-model", "PATH"]
    if machine.get("torch_threads") and machine.get("cpu_count") and machine["torch_threads"] < machine["cpu_count"]:
        out += ["--threads", str(machine["torch_threads"])]
    for key, option, default in (("repeats", "--repeats", 1), ("turns", "--turns", 1),
                                 ("hf_lookup_tokens", "--hf-lookup-tokens", 10)):
        if cfg.get(key) not in (None, default):
            out += [option, str(cfg[key])]
    temp = cfg.get("sampling", {}).get("temperature")
    if temp:
        out += ["--temperature", str(temp), "--seed", str(cfg["sampling"]["seed"])]
    return out


def _x(value, pattern: str = "{:.2f}x") -> str:
    return "-" if value is None else pattern.format(value)


def _count(fraction, n: int) -> str:
    return "-" if fraction is None else f"{round(fraction * n)}/{n}"


def summary_table(results: list[dict]) -> list[str]:
    """One row per set: our fastest mode against hf-prompt-lookup, both as tokens/s relative to hf-ar."""
    rows = [
        "| dataset | prompts | Tandem's fastest mode | its tok/s vs hf-ar | lossless | "
        f"{PEER} tok/s vs hf-ar | lossless | Tandem vs {PEER} |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        n = r["config"]["limit"]
        ours = {m: s for m, s in r["modes"].items() if m in OURS and s.get("tokens_per_s_vs_hf_ar") is not None}
        peer = r["modes"].get(PEER)
        if not ours:
            key = "speedup_vs_ar"  # no hf-ar in this run: ours against ar only
            ours = {m: s for m, s in r["modes"].items() if m in OURS}
        else:
            key = "tokens_per_s_vs_hf_ar"
        best = max(ours, key=lambda m: ours[m].get(key) or 0.0)
        b = ours[best]
        p_ratio = peer.get("tokens_per_s_vs_hf_ar") if peer else None
        ratio = None
        if peer:  # per prompt, like every ratio here: (peer s/token) / (ours s/token), the median
            timing = [[(p["modes"][m]["seconds"], p["modes"][m]["tokens"]) for p in r["prompts"]] for m in (PEER, best)]
            ratio = median_speedup(*timing)
        rows.append(
            f"| {dataset_label(r)} | {n} | {best} | {_x(b.get(key))} | {_count(b['lossless'], n)} | "
            f"{_x(p_ratio)} | {_count(peer['lossless'], n) if peer else '-'} | {_x(ratio)} |"
        )
    return rows


def mode_table(modes: dict, n: int) -> list[str]:
    rows = [
        "| mode | baseline | tokens | tok/s | speedup | vs hf-ar | drafts/reply | accept | tok/step | lossless |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, s in modes.items():
        rows.append(
            f"| {m} | {s.get('baseline', 'ar')} | {s['tokens']} | {_x(s['tokens_per_s'], '{:.1f}')} | "
            f"{speedup_cell(s)} | {_x(s.get('tokens_per_s_vs_hf_ar'))} | {_x(s.get('drafted_per_reply'), '{:.1f}')} | "
            f"{_x(s['acceptance_rate'], '{:.1%}')} | {_x(s['mean_accepted_len'], '{:.2f}')} | "
            f"{_count(s['lossless'], n)} |"
        )
    return rows


def dataset_section(r: dict) -> list[str]:
    n = r["config"]["limit"]
    lines = [f"#### {dataset_label(r)}", "", *mode_table(r["modes"], n), ""]
    notes = sorted({s["lossless_note"] for s in r["modes"].values() if s.get("lossless_note")})
    if notes:
        lines += [f"lossless: {'; '.join(notes)}", ""]
    by_cat = r.get("by_category") or {}
    if len(by_cat) > 1:
        counts: dict[str, int] = {}
        for p in r["prompts"]:
            counts[p["category"] or "(none)"] = counts.get(p["category"] or "(none)", 0) + 1
        modes = list(r["modes"])
        lines += [
            "By category: speedup against the mode's baseline, tok/s vs hf-ar in parentheses, "
            "acceptance after the slash.",
            "",
            "| category | prompts | " + " | ".join(modes) + " |",
            "|---|---:|" + "---:|" * len(modes),
        ]
        for cat, summary in by_cat.items():
            cells = []
            for m in modes:
                s = summary[m]
                cell = speedup_cell(s)
                if s.get("tokens_per_s_vs_hf_ar") is not None:
                    cell += f" ({_x(s['tokens_per_s_vs_hf_ar'])})"
                if s.get("acceptance_rate") is not None:
                    cell += f" / {s['acceptance_rate']:.0%}"
                cells.append(cell)
            lines.append(f"| {cat} | {counts.get(cat, 0)} | " + " | ".join(cells) + " |")
        lines.append("")
    if r.get("by_turn"):
        lines += [
            "Per turn: a later turn's context is the conversation so far with the mode's own replies. Our modes "
            "keep one engine sequence per record, so a later turn computes only its new tokens; transformers' "
            "`generate` has no session and prefills the whole conversation again, as it is used.",
            "",
        ]
    for turn, summary in (r.get("by_turn") or {}).items():
        with_turn = sum(1 for p in r["prompts"] if len(p.get("turns", [])) >= int(turn))
        lines += [f"Turn {turn}:", "", *mode_table(summary, with_turn), ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
