"""Side-by-side benchmark of decoding modes on one engine, as DESIGN.md's "Measuring" asks.

Every prompt runs in every mode in this one process, interleaved: prompt 1 in ar, ngram, model;
prompt 2 in ngram, model, ar; ... The order rotates so that no mode always runs first (right after
another prompt's prefill, or a preemption that a neighbour's job caused), and a slow minute of a
shared machine hits all modes alike. Speed is reported as ratios to plain decoding (`ar`), medians
over prompts, next to the acceptance figures that explain them; output equality with `ar` is
checked on every prompt.

    modes.M.speedup_vs_ar   median over prompts of (ar seconds per token) / (M seconds per token)
    modes.M.lossless        fraction of prompts whose output ids equal ar's (greedy only)
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from collections.abc import Sequence

import torch
from rich.table import Table

from tandem.config import DraftStrategy, SamplingParams
from tandem.datasets import PromptRecord, to_chat
from tandem.models import apply_chat_template
from tandem.progress import progress_bar
from tandem.spec import Engine, GenerationResult

MODES = {"ar": DraftStrategy.none, "ngram": DraftStrategy.ngram, "model": DraftStrategy.model}
WARMUP_TOKENS = 16  # enough steps to touch every code path (prefill, draft, verify, rollback) once
LOSSLESS_NOTE = (
    "sampling with temperature > 0: outputs are equal to ar's in distribution, not token for token, "
    "so greedy equality does not apply"
)


def seconds_per_token(seconds: float, tokens: int) -> float | None:
    """None when undefined (a generation that stopped before its first token)."""
    return seconds / tokens if tokens > 0 and seconds > 0 else None


def speedup_ratios(ar: Sequence[tuple[float, int]], mode: Sequence[tuple[float, int]]) -> list[float]:
    """Per-prompt speedups (ar seconds per token / mode seconds per token) from aligned per-prompt
    (seconds, tokens) pairs; prompts where either side produced no token are left out.

    Per-token times, not total times: under sampling the two modes may emit different lengths, and a
    mode must not look fast because it happened to stop early. Example: ar (2.0 s, 100 tokens) and
    ngram (1.0 s, 80 tokens) give 0.020 / 0.0125 = 1.6.
    """
    if len(ar) != len(mode):
        raise ValueError(f"{len(ar)} ar timings but {len(mode)} mode timings")
    out = []
    for (ar_s, ar_t), (m_s, m_t) in zip(ar, mode):
        a, m = seconds_per_token(ar_s, ar_t), seconds_per_token(m_s, m_t)
        if a is not None and m is not None:
            out.append(a / m)
    return out


def median_speedup(ar: Sequence[tuple[float, int]], mode: Sequence[tuple[float, int]]) -> float | None:
    """The median of `speedup_ratios`; None when no prompt has both timings."""
    ratios = speedup_ratios(ar, mode)
    return statistics.median(ratios) if ratios else None


def lossless_fraction(reference: Sequence[Sequence[int]], runs: Sequence[Sequence[Sequence[int]]]) -> float:
    """Fraction of prompts whose every run's output ids equal the reference's.

    reference[i]: ar's ids for prompt i; runs[i]: the mode's ids of each repeat of prompt i. Any
    difference, a single token or a length, makes the prompt count as not lossless. Example:
    reference [[1, 2], [3]], runs [[[1, 2]], [[3, 4]]] gives 0.5.
    """
    if len(reference) != len(runs):
        raise ValueError(f"{len(reference)} reference outputs but {len(runs)} prompts of runs")
    if not reference:
        raise ValueError("no prompts to compare")
    equal = sum(all(list(r) == list(ref) for r in prompt_runs) for ref, prompt_runs in zip(reference, runs))
    return equal / len(reference)


def rotated(modes: Sequence[str], shift: int) -> list[str]:
    """`modes` started at position `shift`: rotated(["ar", "ngram", "model"], 1) = [ngram, model, ar]."""
    k = shift % len(modes)
    return list(modes[k:]) + list(modes[:k])


def median_run(runs: Sequence[GenerationResult]) -> GenerationResult:
    """The repeat of median time (the lower median for an even count): one real generation whose
    time, tokens and counts belong together, and a preempted repeat cannot skew it."""
    ordered = sorted(runs, key=lambda r: r.seconds)
    return ordered[(len(ordered) - 1) // 2]


class EngineTarget:
    """Bench target: an in-process Engine (the single-process reference loop)."""

    def __init__(self, engine: Engine, tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_id = engine.target.model_id
        self.draft_id = engine.draft.model_id if engine.draft is not None else None

    def prepare(self, rec: PromptRecord) -> tuple[list[int], int]:
        ids = apply_chat_template(self.tokenizer, to_chat(rec, 0))
        if len(ids) >= self.engine.target.max_context:
            raise ValueError(
                f"prompt {rec.id!r} of {rec.dataset} has {len(ids)} tokens and does not fit the "
                f"{self.engine.target.max_context}-token context window of {self.model_id}"
            )
        return ids, len(ids)

    def generate(self, ctx, sampling: SamplingParams, mode: str) -> GenerationResult:
        return self.engine.generate(ctx, sampling, self.engine.spec.model_copy(update={"strategy": MODES[mode]}))

    def machine(self) -> dict:
        return machine_info(self.engine)


def run_bench(
    engine,
    records: Sequence[PromptRecord],
    modes: list[str],
    max_new_tokens: int,
    *,
    tokenizer=None,
    sampling: SamplingParams | None = None,
    progress: bool = True,
    repeats: int = 1,
) -> dict:
    """Run the first turn of every record in every mode, interleaved; return the JSON-able report.

    `engine` is an in-process `Engine` (with `tokenizer`) or any bench target with the interface of
    `EngineTarget` (e.g. `tandem.bench_remote.GatewayTarget`, the same modes through a stack).
    `ar` is the baseline of every ratio, so it is run even when `modes` leaves it out. `sampling`
    defaults to greedy; its max_new_tokens is replaced by `max_new_tokens`. With repeats > 1 each
    prompt runs that many times per mode and its figures are those of the median-time repeat;
    equality with ar is required of every repeat.
    """
    target = EngineTarget(engine, tokenizer) if isinstance(engine, Engine) else engine
    modes = _check_modes(target, modes)
    if not records:
        raise ValueError("no prompts to benchmark")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sampling = (sampling or SamplingParams()).model_copy(update={"max_new_tokens": max_new_tokens})
    greedy = sampling.greedy

    prepared = [target.prepare(rec) for rec in records]
    contexts = [p[0] for p in prepared]

    # Untimed: the first forwards pay for allocation and kernel selection, and the draft model's
    # first forward for its own; one short generation per mode keeps that out of the first prompt.
    warmup = sampling.model_copy(update={"max_new_tokens": min(max_new_tokens, WARMUP_TOKENS)})
    for m in modes:
        target.generate(contexts[0], warmup, m)

    runs: list[dict[str, list[GenerationResult]]] = [{m: [] for m in modes} for _ in records]
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("bench", total=len(records) * len(modes) * repeats)
        for i, ctx in enumerate(contexts):
            for r in range(repeats):
                for m in rotated(modes, i * repeats + r):
                    runs[i][m].append(target.generate(ctx, sampling, m))
                    bar.advance(task)

    chosen = [{m: median_run(prompt_runs[m]) for m in modes} for prompt_runs in runs]
    ar_ids = [prompt_runs["ar"][0].token_ids for prompt_runs in runs]
    prompts = []
    for rec, (_, prompt_tokens), prompt_runs, best in zip(records, prepared, runs, chosen):
        entry = {"id": rec.id, "dataset": rec.dataset, "category": rec.category, "prompt_tokens": prompt_tokens, "modes": {}}
        for m in modes:
            res = best[m]
            entry["modes"][m] = {
                "tokens": len(res.token_ids),
                "seconds": res.seconds,
                "tokens_per_s": res.tokens_per_s,
                "drafted": res.stats.drafted,
                "accepted": res.stats.accepted,
                "steps": res.stats.steps,
                "mean_accepted_len": res.stats.mean_accepted_len,
                "equal_to_ar": (
                    all(x.token_ids == prompt_runs["ar"][0].token_ids for x in prompt_runs[m]) if greedy else None
                ),
            }
        prompts.append(entry)

    ar_timing = [(b["ar"].seconds, len(b["ar"].token_ids)) for b in chosen]
    summary = {}
    for m in modes:
        tokens = sum(len(b[m].token_ids) for b in chosen)
        seconds = sum(b[m].seconds for b in chosen)
        drafted = sum(b[m].stats.drafted for b in chosen)
        accepted = sum(b[m].stats.accepted for b in chosen)
        steps = sum(b[m].stats.steps for b in chosen)
        summary[m] = {
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "speedup_vs_ar": median_speedup(ar_timing, [(b[m].seconds, len(b[m].token_ids)) for b in chosen]),
            "acceptance_rate": accepted / drafted if drafted else None,  # None: nothing was drafted
            "mean_accepted_len": (accepted + steps) / steps if steps else None,
            "lossless": lossless_fraction(ar_ids, [[x.token_ids for x in p[m]] for p in runs]) if greedy else None,
        }
        if not greedy:
            summary[m]["lossless_note"] = LOSSLESS_NOTE

    return {
        "modes": summary,
        "prompts": prompts,
        "config": {
            "model": target.model_id,
            "draft_model": target.draft_id,
            "max_new_tokens": max_new_tokens,
            "limit": len(records),
            "repeats": repeats,
            "machine": target.machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "sampling": sampling.model_dump(mode="json"),
        },
    }


def machine_info(engine: Engine) -> dict:
    device = next(engine.target.model.parameters()).device
    info = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def format_table(result: dict) -> Table:
    """The per-mode summary of a `run_bench` result, for the terminal."""
    cfg = result["config"]
    table = Table(
        title=f"{cfg['model']}: {cfg['limit']} prompts, {cfg['max_new_tokens']} new tokens",
        caption=(
            "speedup: median over prompts of ar's time per token / the mode's, run side by side; "
            "accept: drafts accepted; tok/step: tokens committed per target forward"
        ),
    )
    for col in ("mode", "tokens", "seconds", "tok/s", "speedup", "accept", "tok/step", "lossless"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, s in result["modes"].items():
        table.add_row(
            mode,
            str(s["tokens"]),
            _fmt(s["seconds"], "{:.2f}"),
            _fmt(s["tokens_per_s"], "{:.1f}"),
            _fmt(s["speedup_vs_ar"], "{:.2f}x"),
            _fmt(s["acceptance_rate"], "{:.1%}"),
            _fmt(s["mean_accepted_len"], "{:.2f}"),
            # a count, not a rounded percentage: 199 of 200 equal outputs must not print as 100%
            "-" if s["lossless"] is None else f"{round(s['lossless'] * cfg['limit'])}/{cfg['limit']}",
        )
    notes = {s["lossless_note"] for s in result["modes"].values() if s.get("lossless_note")}
    if notes:
        table.caption += "\nlossless: " + "; ".join(sorted(notes))
    return table


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _check_modes(target, modes: Sequence[str]) -> list[str]:
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(map(repr, unknown))}; choose from {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"modes repeat: {list(modes)}")
    if "model" in modes and target.draft_id is None:
        raise ValueError("mode 'model' needs a draft model (--draft-model PATH)")
    return list(modes) if "ar" in modes else ["ar", *modes]
