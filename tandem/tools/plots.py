"""Plots of `tandem bench` results (PNG, matplotlib), readable without the JSON beside them: each
has a title, labelled axes with units, and a caption naming the model, the machine and the date.

    speedup.png                 speedup by dataset / category and mode (against the mode's own plain
                                decoding; and, when transformers' hf-ar ran, tokens/s relative to it)
    acceptance_by_position.png  acceptance rate of draft position i (drafts accepted / drafted there)
    accepted_length.png         share of target steps by tokens committed per step
    tokens_per_s.png            tokens/s of every prompt, in the order of the run, per mode

Every function takes a list of `run_bench` results (one per dataset), so that `tandem bench --plot`
(one result) and scripts/bench_docs.py (the dev sets together) draw the same figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

BASELINES = ("ar", "hf-ar")
PEERS = ("hf-ar", "hf-prompt-lookup", "hf-assisted")
# One colour per mode in every figure: ours in blues/greens, transformers' in oranges/greys.
COLORS = {
    "ar": "#4c72b0", "ngram": "#2ca02c", "model": "#17becf",
    "hf-ar": "#7f7f7f", "hf-prompt-lookup": "#ff7f0e", "hf-assisted": "#d62728",
}
FILES = ("speedup.png", "acceptance_by_position.png", "accepted_length.png", "tokens_per_s.png")


def write_plots(results: Sequence[dict], out_dir: str | Path, *, prefix: str = "") -> list[Path]:
    """Write the four figures of `results` into `out_dir` (created if needed); return their paths."""
    if not results:
        raise ValueError("no results to plot")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in zip(FILES, (speedup_figure, acceptance_figure, accepted_length_figure, tokens_per_s_figure)):
        fig = draw(results)
        path = out / f"{prefix}{name}"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def dataset_label(result: dict) -> str:
    """The dataset's name: the file stem of config.dataset, else the prompts' dataset field."""
    path = result["config"].get("dataset")
    if path:
        return Path(path).stem
    datasets = {p["dataset"] for p in result["prompts"]}
    return datasets.pop() if len(datasets) == 1 else "prompts"


def caption(results: Sequence[dict]) -> str:
    """Model, run settings, machine and date of the results (the first one's machine and date)."""
    cfg = results[0]["config"]
    machine = cfg.get("machine", {})
    models = cfg["model"] + (f" + draft {cfg['draft_model']}" if cfg.get("draft_model") else "")
    temp = cfg.get("sampling", {}).get("temperature", 0.0)
    decoding = "greedy" if not temp else f"sampling T={temp}, seed {cfg['sampling'].get('seed')}"
    hw = machine.get("gpu") or machine.get("cpu") or machine.get("platform", "?")
    cores = f"{machine['cpu_count']} cores" if machine.get("cpu_count") else ""
    threads = f"{machine['torch_threads']} torch threads" if machine.get("torch_threads") else ""
    where = ", ".join(x for x in (cores, threads, machine.get("device")) if x)
    dates = sorted({r["config"].get("date", "")[:10] for r in results} - {""}) or ["?"]
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return (
        f"{models} · {decoding}, up to {cfg['max_new_tokens']} new tokens, {cfg['limit']} prompts per set · "
        f"{hw} ({where}) · torch {machine.get('torch', '?')} · {when}"
    )


def _figure(results: Sequence[dict], width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    fig.get_layout_engine().set(rect=(0, 0.05, 1, 0.95))
    fig.text(0.5, 0.01, caption(results), ha="center", va="bottom", fontsize=7, color="#444444", wrap=True)
    return fig


def _modes(results: Sequence[dict], exclude: Sequence[str] = ()) -> list[str]:
    seen: list[str] = []
    for r in results:
        seen += [m for m in r["modes"] if m not in seen and m not in exclude]
    return seen


def _groups(results: Sequence[dict]) -> list[tuple[str, dict]]:
    """(label, per-mode summary) for each dataset, then each of its categories when it has several."""
    groups = []
    for r in results:
        name = dataset_label(r)
        groups.append((f"{name}\n(all)", r["modes"]))
        cats = r.get("by_category") or {}
        if len(cats) > 1:
            groups += [(f"{name}\n{c}", s) for c, s in cats.items()]
    return groups


def _bars(ax, groups: list[tuple[str, dict]], modes: list[str], key: str, reference: str) -> None:
    width = 0.8 / max(1, len(modes))
    for k, mode in enumerate(modes):
        xs, ys = [], []
        for g, (_, summary) in enumerate(groups):
            value = summary.get(mode, {}).get(key)
            if value is not None:
                xs.append(g - 0.4 + width * (k + 0.5))
                ys.append(value)
        ax.bar(xs, ys, width, label=mode, color=COLORS.get(mode))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label=f"1 = {reference}")
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=7)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def speedup_figure(results: Sequence[dict]) -> Figure:
    groups = _groups(results)
    peers = any("hf-ar" in r["modes"] for r in results)
    fig = _figure(results, max(8.0, 0.75 * len(groups) + 2), 7.5 if peers else 4.5)
    axes = fig.subplots(2 if peers else 1, 1, squeeze=False)[:, 0]
    ax = axes[0]
    _bars(ax, groups, _modes(results, BASELINES), "speedup_vs_ar", "the mode's own\nplain decoding")
    ax.set_title("Speedup over plain decoding (ours against ar, transformers' against hf-ar)")
    ax.set_ylabel("speedup (x, median over prompts)")
    if peers:
        ax = axes[1]
        _bars(ax, groups, _modes(results, ("hf-ar",)), "tokens_per_s_vs_hf_ar", "transformers'\ngenerate (hf-ar)")
        ax.set_title("Tokens/s relative to transformers' plain generate, same run")
        ax.set_ylabel("tokens/s ratio to hf-ar (x, median)")
    fig.suptitle("Speedup by dataset and category", fontweight="bold")
    return fig


def _spec_modes(results: Sequence[dict]) -> list[str]:
    """Modes that drafted something (the peers report no drafts)."""
    return [
        m for m in _modes(results, BASELINES)
        if any(r["modes"].get(m, {}).get("drafted_by_position") for r in results)
    ]


def acceptance_figure(results: Sequence[dict]) -> Figure:
    fig = _figure(results, 8.0, 4.8)
    ax = fig.subplots()
    styles = ["-", "--", ":", "-."]
    drawn = False
    for mode in _spec_modes(results):
        for j, r in enumerate(results):
            s = r["modes"].get(mode)
            if not s or not s.get("drafted_by_position"):
                continue
            pos = [i + 1 for i, d in enumerate(s["drafted_by_position"]) if d > 0]
            rate = [s["accepted_by_position"][i - 1] / s["drafted_by_position"][i - 1] for i in pos]
            ax.plot(pos, rate, styles[j % len(styles)], marker="o", color=COLORS.get(mode),
                    label=f"{mode}, {dataset_label(r)}")
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no draft-based mode of ours ran (transformers reports no per-position figures)",
                ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=7)
    ax.set_ylim(0, 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position (1 = first drafted token of a step)")
    ax.set_ylabel("acceptance rate (accepted / drafted at that position)")
    ax.set_title("Acceptance by draft position", fontweight="bold")
    ax.grid(alpha=0.3)
    return fig


def accepted_length_figure(results: Sequence[dict]) -> Figure:
    modes = [m for m in _spec_modes(results) if any(r["modes"].get(m, {}).get("steps_by_accepted") for r in results)]
    fig = _figure(results, 8.0, 2.0 + 2.8 * max(1, len(modes)))
    axes = fig.subplots(max(1, len(modes)), 1, squeeze=False)[:, 0]
    if not modes:
        axes[0].text(0.5, 0.5, "no draft-based mode of ours ran", ha="center", va="center",
                     transform=axes[0].transAxes)
    for ax, mode in zip(axes, modes):
        hists = [(dataset_label(r), r["modes"][mode]["steps_by_accepted"]) for r in results
                 if r["modes"].get(mode, {}).get("steps_by_accepted")]
        # the longest block drafted sets the histogram's length; lengths never reached are left out
        longest = max(max((a for a, h in enumerate(hist) if h), default=0) for _, hist in hists) + 1
        hists = [(label, hist[:longest]) for label, hist in hists]
        width = 0.8 / len(hists)
        for j, (label, hist) in enumerate(hists):
            total = sum(hist) or 1
            xs = [a + 1 - 0.4 + width * (j + 0.5) for a in range(len(hist))]
            ax.bar(xs, [100 * h / total for h in hist], width, label=label)
        ax.set_xticks(range(1, longest + 1))
        ax.set_xlabel("tokens committed per target step (1 = no draft accepted)")
        ax.set_ylabel("share of steps (%)")
        ax.set_title(f"{mode}: accepted length per step")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Accepted-length histogram", fontweight="bold")
    return fig


def tokens_per_s_figure(results: Sequence[dict]) -> Figure:
    fig = _figure(results, 9.0, 1.5 + 2.6 * len(results))
    axes = fig.subplots(len(results), 1, squeeze=False)[:, 0]
    for ax, r in zip(axes, results):
        for mode in r["modes"]:
            ys = [p["modes"][mode]["tokens_per_s"] for p in r["prompts"]]
            ax.plot(range(1, len(ys) + 1), ys, marker=".", label=mode, color=COLORS.get(mode),
                    linestyle="--" if mode in PEERS else "-")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(dataset_label(r), fontsize=9)
        ax.set_xlabel("prompt (order of the run)")
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncols=3)
    fig.suptitle("Tokens/s over the prompt set (dashed: transformers' generate)", fontweight="bold")
    return fig
