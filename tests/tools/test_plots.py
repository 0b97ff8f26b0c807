"""Plots and docs/benchmarks.md from bench results: files are written, are PNGs, and a regeneration
keeps what people wrote by hand."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

from tandem.tools.plots import FILES, caption, write_plots

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _summary(mode: str, speedup: float, vs_hf: float | None, *, drafts: bool) -> dict:
    s = {
        "tokens": 256, "seconds": 10.0 / speedup, "tokens_per_s": 25.6 * speedup,
        "baseline": "hf-ar" if mode.startswith("hf-") else "ar",
        "speedup_vs_ar": speedup, "tokens_per_s_vs_hf_ar": vs_hf,
        "acceptance_rate": None, "mean_accepted_len": None if mode.startswith("hf-") else 1.0,
        "drafted_by_position": None, "accepted_by_position": None, "steps_by_accepted": None,
        "lossless": 1.0, "agreement_with_ar": 1.0,
    }
    if not mode.startswith("hf-"):
        s.update(drafted_by_position=[], accepted_by_position=[], steps_by_accepted=[256])
    if drafts:
        s.update(acceptance_rate=0.5, mean_accepted_len=1.6, drafted_by_position=[100, 80, 40],
                 accepted_by_position=[60, 30, 10], steps_by_accepted=[60, 30, 20, 10])
    return s


def synthetic_result(dataset: str, categories: list[str | None]) -> dict:
    """A `run_bench` report in shape, with made-up figures: 4 modes, one prompt per category."""
    modes = {
        "ar": _summary("ar", 1.0, 1.3, drafts=False),
        "ngram": _summary("ngram", 1.4, 1.8, drafts=True),
        "hf-ar": _summary("hf-ar", 1.0, 1.0, drafts=False),
        "hf-prompt-lookup": _summary("hf-prompt-lookup", 0.9, 0.9, drafts=False),
    }
    prompts = [
        {"id": str(i), "dataset": dataset, "category": c, "prompt_tokens": 50,
         "modes": {m: {"tokens": 64, "seconds": 2.0 + 0.1 * i, "tokens_per_s": 64 / (2.0 + 0.1 * i)} for m in modes}}
        for i, c in enumerate(categories)
    ]
    result = {"modes": modes, "prompts": prompts, "config": {
        "model": "SmolLM2-135M-Instruct", "draft_model": None, "max_new_tokens": 64, "limit": len(prompts),
        "repeats": 1, "turns": 1, "hf_lookup_tokens": 10,
        "machine": {"platform": "Linux", "cpu": "Test CPU", "python": "3.11", "torch": "2.13.0", "cpu_count": 2,
                    "torch_threads": 1, "device": "cpu"},
        "date": "2026-01-02T03:04:05+00:00",
        "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "max_new_tokens": 64},
        "dataset": f"{dataset}.jsonl",
    }}
    if any(c is not None for c in categories):
        result["by_category"] = {c or "(none)": modes for c in dict.fromkeys(categories)}
    return result


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert width > 300 and height > 200 and len(data) > 5_000, path


def test_bench_plots_are_pngs(tmp_path: Path) -> None:
    results = [
        synthetic_result("mt_bench_question", ["writing", "math", "coding"]),
        synthetic_result("HumanEval", [None] * 3),
    ]
    paths = write_plots(results, tmp_path / "plots")
    assert [p.name for p in paths] == list(FILES)
    for p in paths:
        _assert_png(p)


def test_plots_without_drafts_or_peers(tmp_path: Path) -> None:
    result = synthetic_result("gsm8k_question", [None, None])
    result["modes"] = {"ar": result["modes"]["ar"]}  # plain decoding only: nothing drafted, no peer
    for p in result["prompts"]:
        p["modes"] = {"ar": p["modes"]["ar"]}
    for p in write_plots([result], tmp_path, prefix="gsm8k_"):
        assert p.name.startswith("gsm8k_")
        _assert_png(p)
    with pytest.raises(ValueError):
        write_plots([], tmp_path)


def test_caption_names_model_machine_and_date() -> None:
    text = caption([synthetic_result("HumanEval", [None])])
    for part in ("SmolLM2-135M-Instruct", "greedy", "Test CPU", "2 cores", "1 torch threads", "2026-01-02"):
        assert part in text


# --- docs/benchmarks.md ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_docs():
    spec = importlib.util.spec_from_file_location("bench_docs", ROOT / "scripts" / "bench_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_regeneration_keeps_the_reading_and_kept_sections(tmp_path: Path, bench_docs) -> None:
    results_dir = tmp_path / "results"
    results_dir.mkdir()
    (results_dir / "humaneval.json").write_text(json.dumps(synthetic_result("HumanEval", [None] * 3)))
    (results_dir / "mt_bench.json").write_text(json.dumps(synthetic_result("mt_bench_question", ["writing", "math"])))
    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    docs.write_text(
        "# old page\n\n<!-- reading -->\nTandem wins on code, loses nowhere.\n<!-- /reading -->\n\nold table\n\n"
        "<!-- keep -->\n## Distributed\n| a | b |\n<!-- /keep -->\n"
    )
    argv = ["--from-results", "--results", str(results_dir), "--docs", str(docs)]
    assert bench_docs.main(argv) == 0
    text = docs.read_text()
    assert text.startswith("# Benchmarks")
    assert "scripts/bench_docs.py --limit 3 --max-new-tokens 64 --modes ar,ngram,hf-ar,hf-prompt-lookup" in text
    assert "<!-- reading -->\nTandem wins on code, loses nowhere.\n<!-- /reading -->" in text
    assert "<!-- keep -->\n## Distributed\n| a | b |\n<!-- /keep -->" in text and "old table" not in text
    assert "Test CPU" in text and "SmolLM2-135M-Instruct" in text and "2026-01-02" in text
    assert "### HumanEval" in text and "### mt_bench_question" in text
    # the summary row: ngram is the fastest of ours; 1.8 / 0.9 per prompt = 2x hf-prompt-lookup
    assert "| HumanEval | 3 | ngram | 1.80x | 3/3 | 0.90x | 3/3 |" in text
    assert "| writing | 1 |" in text and "| math | 1 |" in text  # by category
    for name in FILES:
        assert f"](plots/{name})" in text
        _assert_png(docs.parent / "plots" / name)
    # a second regeneration is stable
    assert bench_docs.main(argv) == 0 and docs.read_text() == text


def test_a_fresh_page_gets_a_reading_placeholder(bench_docs) -> None:
    text = bench_docs.render([synthetic_result("HumanEval", [None])])
    assert f"<!-- reading -->\n{bench_docs.READING_PLACEHOLDER}\n<!-- /reading -->" in text
    assert "<!-- keep -->" not in text


def test_the_page_shows_the_machines_cost_curve(bench_docs) -> None:
    result = synthetic_result("HumanEval", [None])
    assert "Cost curve" not in bench_docs.render([result])  # older reports have none: nothing invented
    result["config"]["machine"]["cost_curve"] = {
        "cpu": "Test CPU", "threads": 2, "torch_version": "2.13.0", "read_gbs": 30.0, "copy_gbs": 15.0,
        "weight_mb": 540.0, "bound_ms": 18.0, "read_gbs_range": [30.0, 29.0],
        "curve_ms": {"100": {"1": 27.0, "2": 30.0, "9": 40.5}}, "gemm": {},
        "ratios": {"100": {"one_over_bound": 1.5, "nine_over_one": 1.5}},
    }
    text = bench_docs.render([result])
    assert "Cost curve (Test CPU, 2 threads, torch 2.13.0)" in text and "no faster than 18.00 ms" in text
    assert "| context | 1 tok | 2 tok | 9 tok | 1 tok / bound | 9 tok / 1 tok |" in text
    assert "| 100 | 27.0 | 30.0 | 40.5 | 1.5x | 1.5x |" in text
