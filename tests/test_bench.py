"""The benchmark: its arithmetic, and one interleaved run of every mode on tiny random Llamas."""

from __future__ import annotations

import io
import json
import statistics
from pathlib import Path

import pytest
from rich.console import Console

from tandem.bench import (
    LOSSLESS_NOTE,
    format_table,
    lossless_fraction,
    median_run,
    median_speedup,
    rotated,
    run_bench,
    speedup_ratios,
)
from tandem.config import SamplingParams
from tandem.datasets import PromptRecord, load_prompts, to_chat
from tandem.models import apply_chat_template
from tandem.spec import Engine, FinishReason, GenerationResult, SpecStats

MODE_KEYS = {"tokens", "seconds", "tokens_per_s", "speedup_vs_ar", "acceptance_rate", "mean_accepted_len", "lossless"}
PROMPT_MODE_KEYS = {
    "tokens", "seconds", "tokens_per_s", "drafted", "accepted", "steps", "mean_accepted_len", "equal_to_ar",
}


# --- arithmetic -------------------------------------------------------------------------------------


def test_speedup_is_a_per_token_time_ratio() -> None:
    # ar 20 ms/token, ngram 12.5 ms/token: 1.6 although ngram stopped earlier
    assert speedup_ratios([(2.0, 100)], [(1.0, 80)]) == [pytest.approx(1.6)]


def test_median_speedup_over_prompts() -> None:
    ar = [(1.0, 10), (1.0, 10), (1.0, 10)]
    mode = [(0.5, 10), (2.0, 10), (0.25, 10)]  # ratios 2, 0.5, 4
    assert median_speedup(ar, mode) == 2.0
    assert median_speedup(ar[:2], mode[:2]) == pytest.approx(1.25)  # even count: mean of the middle two
    assert median_speedup(ar, ar) == 1.0


def test_speedup_leaves_out_prompts_without_tokens() -> None:
    ar = [(1.0, 0), (1.0, 10), (1.0, 10)]
    mode = [(0.5, 10), (0.5, 0), (0.5, 10)]
    assert speedup_ratios(ar, mode) == [2.0]
    assert median_speedup([(1.0, 0)], [(1.0, 5)]) is None
    with pytest.raises(ValueError):
        speedup_ratios(ar, mode[:2])


def test_lossless_fraction() -> None:
    reference = [[1, 2, 3], [4, 5], [6]]
    assert lossless_fraction(reference, [[r] for r in reference]) == 1.0
    assert lossless_fraction(reference, [[[1, 2, 3]], [[4, 9]], [[6]]]) == pytest.approx(2 / 3)
    assert lossless_fraction(reference, [[[1, 2]], [[4, 5]], [[6, 7]]]) == pytest.approx(1 / 3)  # lengths differ
    # every repeat must agree: one deviating repeat makes the prompt fail
    assert lossless_fraction([[1]], [[[1], [1], [2]]]) == 0.0
    with pytest.raises(ValueError):
        lossless_fraction([], [])
    with pytest.raises(ValueError):
        lossless_fraction(reference, [[r] for r in reference[:2]])


def test_rotation_puts_every_mode_first_in_turn() -> None:
    modes = ["ar", "ngram", "model"]
    firsts = [rotated(modes, i)[0] for i in range(6)]
    assert firsts == ["ar", "ngram", "model", "ar", "ngram", "model"]
    assert rotated(modes, 1) == ["ngram", "model", "ar"]


def _result(seconds: float, tokens: int = 3) -> GenerationResult:
    return GenerationResult(
        token_ids=list(range(tokens)), finish_reason=FinishReason.length, stats=SpecStats(),
        prompt_tokens=1, seconds=seconds, first_token_seconds=0.0,
    )


def test_median_run_is_one_real_repeat() -> None:
    runs = [_result(3.0), _result(1.0), _result(9.0)]
    assert median_run(runs) is runs[0]
    assert median_run(runs[:2]).seconds == 1.0  # the lower median for an even count
    assert median_run([runs[2]]) is runs[2]


# --- end to end on tiny models ----------------------------------------------------------------------


@pytest.fixture
def records(tmp_path: Path) -> list[PromptRecord]:
    # Repetitive prompts, so that prompt lookup finds matches; one carries a system message.
    path = tmp_path / "tiny_set.jsonl"
    lines = [
        {"id": "a", "category": "rep", "turns": ["the cat and the dog and the cat and the dog and the"]},
        {"id": "b", "category": "code", "prompt": "def add ( a , b ) : return a + b def add ( a , b ) :"},
        {"id": "c", "messages": [
            {"role": "system", "content": "be kind"},
            {"role": "user", "content": "one two one two one"},
        ]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return load_prompts(path)


def test_run_bench_end_to_end(tiny_loaded, tiny_draft_loaded, records) -> None:
    engine = Engine(tiny_loaded, tiny_draft_loaded)
    result = run_bench(
        engine, records, ["ar", "ngram", "model"], 24, tokenizer=tiny_loaded.tokenizer, progress=False
    )
    json.dumps(result)  # the report is plain JSON
    assert set(result) == {"modes", "prompts", "config"}
    assert list(result["modes"]) == ["ar", "ngram", "model"]
    for mode, s in result["modes"].items():
        assert MODE_KEYS <= set(s) and "lossless_note" not in s, mode
        assert s["lossless"] == 1.0, mode  # greedy: every mode reproduces ar token for token
        assert s["speedup_vs_ar"] > 0 and s["tokens"] > 0 and s["seconds"] > 0
        assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["seconds"])
    ar = result["modes"]["ar"]
    assert ar["speedup_vs_ar"] == 1.0 and ar["mean_accepted_len"] == 1.0 and ar["acceptance_rate"] is None
    ngram = result["modes"]["ngram"]
    assert 0.0 <= ngram["acceptance_rate"] <= 1.0 and ngram["mean_accepted_len"] >= 1.0

    assert [p["id"] for p in result["prompts"]] == ["a", "b", "c"]
    for p in result["prompts"]:
        assert {"id", "dataset", "category", "prompt_tokens", "modes"} <= set(p)
        assert p["dataset"] == "tiny_set" and p["prompt_tokens"] > 0
        for mode, m in p["modes"].items():
            assert set(m) == PROMPT_MODE_KEYS, mode
            assert m["equal_to_ar"] is True and m["tokens"] == p["modes"]["ar"]["tokens"]
        ar_p = p["modes"]["ar"]
        # plain decoding: one step per token, plus the step that produced a stop token if one came
        assert ar_p["drafted"] == 0 and ar_p["steps"] - ar_p["tokens"] in (0, 1)
    # the summary is built from the per-prompt figures
    for mode, s in result["modes"].items():
        per = [p["modes"][mode] for p in result["prompts"]]
        assert s["tokens"] == sum(m["tokens"] for m in per)
        assert s["seconds"] == pytest.approx(sum(m["seconds"] for m in per))
        steps = sum(m["steps"] for m in per)
        assert s["mean_accepted_len"] == pytest.approx((sum(m["accepted"] for m in per) + steps) / steps)
        ratios = [
            (p["modes"]["ar"]["seconds"] / p["modes"]["ar"]["tokens"]) / (m["seconds"] / m["tokens"])
            for p, m in zip(result["prompts"], per)
        ]
        assert s["speedup_vs_ar"] == pytest.approx(statistics.median(ratios))

    cfg = result["config"]
    assert {"model", "max_new_tokens", "limit", "machine", "date", "sampling"} <= set(cfg)
    assert cfg["model"] == "tiny" and cfg["max_new_tokens"] == 24 and cfg["limit"] == 3
    assert cfg["sampling"]["temperature"] == 0.0 and cfg["sampling"]["max_new_tokens"] == 24
    assert cfg["machine"]["cpu_count"] >= 1 and cfg["machine"]["torch_threads"] >= 1

    console = Console(file=io.StringIO(), width=140)
    console.print(format_table(result))
    text = console.file.getvalue()
    assert "ngram" in text and "1.00x" in text and "3/3" in text


def test_modes_are_interleaved_and_rotated_after_a_warmup(tiny_loaded, records, monkeypatch) -> None:
    engine = Engine(tiny_loaded)
    calls: list[tuple[int, str, int]] = []
    real = engine.generate

    def spy(context_ids, sampling, spec=None, **kw):
        calls.append((len(context_ids), spec.strategy.value, sampling.max_new_tokens))
        return real(context_ids, sampling, spec, **kw)

    monkeypatch.setattr(engine, "generate", spy)
    # ar is the baseline of every ratio: it runs although the modes leave it out
    result = run_bench(engine, records, ["ngram"], 6, tokenizer=tiny_loaded.tokenizer, progress=False, repeats=2)
    assert list(result["modes"]) == ["ar", "ngram"]
    warmup, timed = calls[:2], calls[2:]
    assert [c[1] for c in warmup] == ["none", "ngram"]
    assert [c[1] for c in timed] == ["none", "ngram", "ngram", "none"] * 3  # rotated per prompt and repeat
    lengths = [p["prompt_tokens"] for p in result["prompts"]]
    assert [c[0] for c in timed] == [n for n in lengths for _ in range(4)]  # prompt by prompt
    assert all(c[2] == 6 for c in calls)


def test_a_lossless_failure_is_reported(tiny_loaded, records, monkeypatch) -> None:
    """A mode whose output differs from ar's on one prompt of three scores 2/3, and that prompt is
    marked, so a broken verifier cannot hide in the averages."""
    engine = Engine(tiny_loaded)
    real = engine.generate
    lengths = [len(apply_chat_template(tiny_loaded.tokenizer, to_chat(r))) for r in records]
    assert len(set(lengths)) == len(lengths)  # the prompt length identifies the prompt below
    bad_prompt_len = lengths[1]

    def corrupt(context_ids, sampling, spec=None, **kw):
        res = real(context_ids, sampling, spec, **kw)
        if spec.strategy.value == "ngram" and len(context_ids) == bad_prompt_len:
            res.token_ids = res.token_ids[:-1] + [(res.token_ids[-1] + 1) % 512]
        return res

    monkeypatch.setattr(engine, "generate", corrupt)
    result = run_bench(engine, records, ["ar", "ngram"], 5, tokenizer=tiny_loaded.tokenizer, progress=False)
    assert result["modes"]["ngram"]["lossless"] == pytest.approx(2 / 3)
    assert result["modes"]["ar"]["lossless"] == 1.0
    assert [p["modes"]["ngram"]["equal_to_ar"] for p in result["prompts"]] == [True, False, True]
    console = Console(file=io.StringIO(), width=140)
    console.print(format_table(result))
    assert "2/3" in console.file.getvalue()


def test_sampling_reports_no_greedy_equality(tiny_loaded, records) -> None:
    engine = Engine(tiny_loaded)
    sampling = SamplingParams(temperature=0.8, seed=3)
    result = run_bench(
        engine, records[:2], ["ar", "ngram"], 5, tokenizer=tiny_loaded.tokenizer, sampling=sampling, progress=False
    )
    for s in result["modes"].values():
        assert s["lossless"] is None and s["lossless_note"] == LOSSLESS_NOTE
    assert all(m["equal_to_ar"] is None for p in result["prompts"] for m in p["modes"].values())
    assert result["config"]["sampling"]["temperature"] == 0.8 and result["config"]["sampling"]["max_new_tokens"] == 5
    console = Console(file=io.StringIO(), width=200)
    console.print(format_table(result))
    assert "greedy equality does not apply" in console.file.getvalue()


def test_bad_modes_are_refused(tiny_loaded, records) -> None:
    engine = Engine(tiny_loaded)  # no draft model
    tok = tiny_loaded.tokenizer
    with pytest.raises(ValueError, match="needs a draft model"):
        run_bench(engine, records, ["ar", "model"], 4, tokenizer=tok, progress=False)
    with pytest.raises(ValueError, match="unknown mode"):
        run_bench(engine, records, ["ar", "eagle"], 4, tokenizer=tok, progress=False)
    with pytest.raises(ValueError, match="no prompts"):
        run_bench(engine, [], ["ar"], 4, tokenizer=tok, progress=False)
