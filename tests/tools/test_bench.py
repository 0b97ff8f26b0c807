"""The benchmark: its arithmetic, and one interleaved run of every mode on tiny random Llamas."""

from __future__ import annotations

import io
import json
import statistics
from pathlib import Path

import pytest
from rich.console import Console

from tandem.tools.bench import (
    LOSSLESS_NOTE,
    EngineTarget,
    format_category_table,
    format_table,
    lossless_fraction,
    median_run,
    median_speedup,
    rotated,
    run_bench,
    run_seed,
    speedup_ratios,
    steps_by_accepted,
)
from tandem.contract.ids import common_prefix_len
from tandem.contract.params import SamplingParams, SpecConfig
from tandem.contract.results import GenerationResult
from tandem.contract.results import FinishReason, SpecStats
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.scheduler.generate import Engine
from tandem.tools.datasets import PromptRecord, load_prompts, to_chat

MODE_KEYS = {
    "tokens", "seconds", "tokens_per_s", "speedup_vs_ar", "acceptance_rate", "mean_accepted_len", "lossless",
    "baseline", "tokens_per_s_vs_hf_ar", "agreement_with_ar", "drafted_by_position", "accepted_by_position",
    "steps_by_accepted",
}
PROMPT_MODE_KEYS = {
    "tokens", "seconds", "tokens_per_s", "drafted", "accepted", "steps", "mean_accepted_len", "equal_to_ar",
    "equal_to_baseline",
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
    # a conversation's output is one id list per turn: a difference in any turn counts
    assert lossless_fraction([[[1, 2], [3]]], [[[[1, 2], [3]]]]) == 1.0
    assert lossless_fraction([[[1, 2], [3]]], [[[[1, 2], [4]]]]) == 0.0
    with pytest.raises(ValueError):
        lossless_fraction([], [])
    with pytest.raises(ValueError):
        lossless_fraction(reference, [[r] for r in reference[:2]])


def test_rotation_puts_every_mode_first_in_turn() -> None:
    modes = ["ar", "ngram", "model"]
    firsts = [rotated(modes, i)[0] for i in range(6)]
    assert firsts == ["ar", "ngram", "model", "ar", "ngram", "model"]
    assert rotated(modes, 1) == ["ngram", "model", "ar"]


def test_steps_by_accepted_histogram() -> None:
    # 10 steps; 6 accepted >= 1 draft, 2 accepted >= 2: 4 steps accepted 0, 4 accepted 1, 2 accepted 2
    st = SpecStats(drafted=12, accepted=8, steps=10, accepted_by_position=[6, 2], drafted_by_position=[8, 4])
    assert steps_by_accepted(st) == [4, 4, 2]
    assert steps_by_accepted(SpecStats(steps=5)) == [5]  # plain decoding: every step commits one token
    assert steps_by_accepted(SpecStats(drafted=4, accepted=3, steps=2)) is None  # totals only (remote)


def test_run_seeds_differ_per_prompt_and_turn() -> None:
    seeds = [run_seed(7, i, t, 2) for i in range(3) for t in range(2)]
    assert seeds == [7, 8, 9, 10, 11, 12]
    assert run_seed(7, 0, 0, 1) == 7 and run_seed(7, 1, 0, 1) == 8


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
    # fixed block lengths: whether the adaptive controller drafts depends on measured times
    engine = Engine(tiny_loaded, tiny_draft_loaded, SpecConfig(adaptive=False))
    result = run_bench(
        engine, records, ["ar", "ngram", "model"], 24, tokenizer=tiny_loaded.tokenizer, progress=False
    )
    json.dumps(result)  # the report is plain JSON
    assert set(result) == {"modes", "prompts", "config", "by_category"}  # no by_turn: one turn
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
    for mode in ("ngram", "model"):  # the per-position counts add up to the totals
        s, per = result["modes"][mode], [p["modes"][mode] for p in result["prompts"]]
        assert sum(s["drafted_by_position"]) == sum(m["drafted"] for m in per) > 0
        assert sum(s["accepted_by_position"]) == sum(m["accepted"] for m in per)
        assert sum(s["steps_by_accepted"]) == sum(m["steps"] for m in per)
    assert ar["drafted_by_position"] == []
    assert ar["steps_by_accepted"] == [sum(p["modes"]["ar"]["steps"] for p in result["prompts"])]

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


def _spy_runs(monkeypatch) -> list[tuple[list[int], str, SamplingParams]]:
    """Record every generation a bench runs in process: (context ids, mode, sampling)."""
    calls: list[tuple[list[int], str, SamplingParams]] = []
    real = EngineTarget.run

    def spy(self, ids, sampling, mode, sequence, proposer=None):
        calls.append((list(ids), mode, sampling))
        return real(self, ids, sampling, mode, sequence, proposer)

    monkeypatch.setattr(EngineTarget, "run", spy)
    return calls


def test_modes_are_interleaved_and_rotated_after_a_warmup(tiny_loaded, records, monkeypatch) -> None:
    engine = Engine(tiny_loaded)
    runs = _spy_runs(monkeypatch)
    # ar is the baseline of every ratio: it runs although the modes leave it out
    result = run_bench(engine, records, ["ngram"], 6, tokenizer=tiny_loaded.tokenizer, progress=False, repeats=2)
    assert list(result["modes"]) == ["ar", "ngram"]
    calls = [(len(ids), mode, s.max_new_tokens) for ids, mode, s in runs]
    warmup, timed = calls[:2], calls[2:]
    assert [c[1] for c in warmup] == ["ar", "ngram"]
    assert [c[1] for c in timed] == ["ar", "ngram", "ngram", "ar"] * 3  # rotated per prompt and repeat
    lengths = [p["prompt_tokens"] for p in result["prompts"]]
    assert [c[0] for c in timed] == [n for n in lengths for _ in range(4)]  # prompt by prompt
    assert all(c[2] == 6 for c in calls)


def test_a_lossless_failure_is_reported(tiny_loaded, records, monkeypatch) -> None:
    """A mode whose output differs from ar's on one prompt of three scores 2/3, and that prompt is
    marked, so a broken verifier cannot hide in the averages."""
    engine = Engine(tiny_loaded)
    _corrupt(monkeypatch, tiny_loaded, records[1], "ngram")
    result = run_bench(engine, records, ["ar", "ngram"], 5, tokenizer=tiny_loaded.tokenizer, progress=False)
    assert result["modes"]["ngram"]["lossless"] == pytest.approx(2 / 3)
    assert result["modes"]["ar"]["lossless"] == 1.0
    assert [p["modes"]["ngram"]["equal_to_ar"] for p in result["prompts"]] == [True, False, True]
    console = Console(file=io.StringIO(), width=140)
    console.print(format_table(result))
    assert "2/3" in console.file.getvalue()


def _corrupt(monkeypatch, loaded, bad_record: PromptRecord, bad_mode: str) -> None:
    """Make `bad_mode` change the last output token of `bad_record` (recognized by its prompt length)."""
    bad_len = len(apply_chat_template(loaded.tokenizer, to_chat(bad_record)))
    real = EngineTarget.run

    def corrupt(self, ids, sampling, mode, sequence, proposer=None):
        res = real(self, ids, sampling, mode, sequence, proposer)
        if mode == bad_mode and len(ids) == bad_len:
            res.token_ids = res.token_ids[:-1] + [(res.token_ids[-1] + 1) % 512]
        return res

    monkeypatch.setattr(EngineTarget, "run", corrupt)


def test_a_peer_lossless_failure_is_reported(tiny_loaded, records, monkeypatch) -> None:
    """The peers are checked like ours: against their baseline hf-ar, and against our ar."""
    lengths = [len(apply_chat_template(tiny_loaded.tokenizer, to_chat(r))) for r in records]
    assert len(set(lengths)) == len(lengths)  # the prompt length identifies the prompt
    _corrupt(monkeypatch, tiny_loaded, records[2], "hf-prompt-lookup")
    result = run_bench(Engine(tiny_loaded), records, ["ar", "hf-prompt-lookup"], 5, tokenizer=tiny_loaded.tokenizer,
                       progress=False)
    peer = result["modes"]["hf-prompt-lookup"]
    assert peer["lossless"] == pytest.approx(2 / 3) and peer["agreement_with_ar"] == pytest.approx(2 / 3)
    assert result["modes"]["hf-ar"]["lossless"] == 1.0
    flags = [p["modes"]["hf-prompt-lookup"]["equal_to_baseline"] for p in result["prompts"]]
    assert flags == [True, True, False]


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
    with pytest.raises(ValueError, match="'hf-assisted' needs a draft model"):
        run_bench(engine, records, ["hf-assisted"], 4, tokenizer=tok, progress=False)
    with pytest.raises(ValueError, match="turns must be"):
        run_bench(engine, records, ["ar"], 4, tokenizer=tok, progress=False, turns=0)
    with pytest.raises(ValueError, match="unknown mode"):
        run_bench(engine, records, ["ar", "eagle"], 4, tokenizer=tok, progress=False)
    with pytest.raises(ValueError, match="no prompts"):
        run_bench(engine, [], ["ar"], 4, tokenizer=tok, progress=False)


def test_sampled_modes_share_a_seed_per_prompt(tiny_loaded, records, monkeypatch) -> None:
    runs = _spy_runs(monkeypatch)
    sampling = SamplingParams(temperature=0.9)  # no seed: the bench uses 0, so that the run replays
    result = run_bench(Engine(tiny_loaded), records, ["ar", "ngram", "hf-ar"], 4, tokenizer=tiny_loaded.tokenizer,
                       sampling=sampling, progress=False)
    assert result["config"]["sampling"]["seed"] == 0
    timed = runs[3:]  # after one warmup per mode
    seeds = {}
    for ids, mode, s in timed:
        seeds.setdefault(len(ids), set()).add(s.seed)
    assert [seeds[p["prompt_tokens"]] for p in result["prompts"]] == [{0}, {1}, {2}]
    assert all(s["lossless"] is None and s["lossless_note"] == LOSSLESS_NOTE for s in result["modes"].values())
    assert all(s["agreement_with_ar"] is None for s in result["modes"].values())


# --- the peer: transformers' own generate in the same run -------------------------------------------


def test_peers_run_beside_ours_and_are_lossless(tiny_loaded, tiny_draft_loaded, records) -> None:
    engine = Engine(tiny_loaded, tiny_draft_loaded)
    modes = ["ar", "ngram", "hf-prompt-lookup", "hf-assisted"]
    result = run_bench(engine, records, modes, 16, tokenizer=tiny_loaded.tokenizer, progress=False)
    json.dumps(result)
    # hf-ar, the peers' baseline, runs whenever a peer does, first among them
    assert list(result["modes"]) == ["ar", "ngram", "hf-ar", "hf-prompt-lookup", "hf-assisted"]
    assert result["config"]["hf_lookup_tokens"] == 10
    for mode, s in result["modes"].items():
        assert MODE_KEYS <= set(s), mode
        assert s["baseline"] == ("hf-ar" if mode.startswith("hf-") else "ar")
        # greedy: every mode equals its baseline, and transformers' plain decoding equals ours
        assert s["lossless"] == 1.0 and s["agreement_with_ar"] == 1.0, mode
        assert s["tokens"] == result["modes"]["ar"]["tokens"]
    for mode in ("hf-ar", "hf-prompt-lookup", "hf-assisted"):
        s = result["modes"][mode]
        assert s["acceptance_rate"] is None and s["mean_accepted_len"] is None  # transformers reports none
        assert s["drafted_by_position"] is None and s["steps_by_accepted"] is None
    assert result["modes"]["hf-ar"]["speedup_vs_ar"] == 1.0 and result["modes"]["hf-ar"]["tokens_per_s_vs_hf_ar"] == 1.0
    for p in result["prompts"]:
        for mode, m in p["modes"].items():
            assert set(m) == PROMPT_MODE_KEYS and m["equal_to_ar"] is True and m["equal_to_baseline"] is True
        assert p["modes"]["hf-ar"]["drafted"] is None

    def per_token(p, mode):
        return p["modes"][mode]["seconds"] / p["modes"][mode]["tokens"]

    for mode, s in result["modes"].items():  # the two ratios: against the own baseline, and against hf-ar
        base = s["baseline"]
        assert s["speedup_vs_ar"] == pytest.approx(
            statistics.median(per_token(p, base) / per_token(p, mode) for p in result["prompts"]))
        assert s["tokens_per_s_vs_hf_ar"] == pytest.approx(
            statistics.median(per_token(p, "hf-ar") / per_token(p, mode) for p in result["prompts"]))
    console = Console(file=io.StringIO(), width=160)
    console.print(format_table(result))
    assert "vs hf-ar" in console.file.getvalue() and "hf-prompt-lookup" in console.file.getvalue()


def test_hf_lookup_tokens_reaches_generate(tiny_loaded, records, monkeypatch) -> None:
    seen = []
    model = tiny_loaded.model
    real = type(model).generate

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("prompt_lookup_num_tokens"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", spy)
    result = run_bench(Engine(tiny_loaded), records[:1], ["hf-prompt-lookup"], 4, tokenizer=tiny_loaded.tokenizer,
                       progress=False, hf_lookup_tokens=3)
    assert list(result["modes"]) == ["hf-ar", "hf-prompt-lookup"]  # peers only: no ar, no agreement figure
    assert sorted(seen, key=str) == [3, 3, None, None]  # warmup and timed run of each mode
    assert result["modes"]["hf-prompt-lookup"]["agreement_with_ar"] is None


def test_peers_need_an_in_process_engine(records) -> None:
    class RemoteLike:  # the interface of tandem.tools.bench_remote.GatewayTarget
        model_id, draft_id = "remote", None

        def prepare(self, rec):
            return rec.turns[0], None

        def generate(self, ctx, sampling, mode):
            raise AssertionError("not reached")

        def machine(self):
            return {}

    with pytest.raises(ValueError, match="run in process only"):
        run_bench(RemoteLike(), records, ["ar", "hf-ar"], 4, progress=False)
    with pytest.raises(ValueError, match="turns > 1 needs sessions"):
        run_bench(RemoteLike(), records, ["ar"], 4, progress=False, turns=2)


# --- categories and turns ----------------------------------------------------------------------------


def test_results_by_category(tiny_loaded, records) -> None:
    result = run_bench(Engine(tiny_loaded), records, ["ar", "ngram"], 8, tokenizer=tiny_loaded.tokenizer,
                       progress=False)
    by_cat = result["by_category"]
    assert list(by_cat) == ["rep", "code", "(none)"]  # in the order of the set; a record without one last
    for cat, summary in by_cat.items():
        prompts = [p for p in result["prompts"] if (p["category"] or "(none)") == cat]
        assert len(prompts) == 1
        for mode, s in summary.items():
            m = prompts[0]["modes"][mode]
            assert MODE_KEYS <= set(s)
            assert s["tokens"] == m["tokens"] and s["seconds"] == pytest.approx(m["seconds"])
            assert s["lossless"] == 1.0
            expected = (m["accepted"] + m["steps"]) / m["steps"]
            assert s["mean_accepted_len"] == pytest.approx(expected)
    console = Console(file=io.StringIO(), width=140)
    console.print(format_category_table(result))
    assert "rep" in console.file.getvalue() and "code" in console.file.getvalue()


def test_no_categories_no_breakdown(tiny_loaded) -> None:
    recs = [PromptRecord(id=str(i), dataset="d", category=None, system=None, turns=[f"one two {i}"]) for i in range(2)]
    result = run_bench(Engine(tiny_loaded), recs, ["ar"], 4, tokenizer=tiny_loaded.tokenizer, progress=False)
    assert "by_category" not in result and format_category_table(result) is None


def test_turns_run_in_order_in_one_session(tiny_loaded, tiny_draft_loaded, monkeypatch) -> None:
    recs = [
        PromptRecord(id="mt", dataset="mt", category="writing", system="be kind",
                     turns=["the cat and the dog and the cat", "one two one two one two"]),
        PromptRecord(id="single", dataset="mt", category="math", system=None, turns=["two three two three"]),
    ]
    runs = _spy_runs(monkeypatch)
    modes = ["ar", "ngram", "model", "hf-prompt-lookup"]
    result = run_bench(Engine(tiny_loaded, tiny_draft_loaded), recs, modes, 10, tokenizer=tiny_loaded.tokenizer,
                       progress=False, turns=2)
    json.dumps(result)
    timed = runs[5:]  # after one warmup per mode (hf-ar included)
    assert len(timed) == 3 * 5  # 2 turns of the first record and 1 of the second, in 5 modes
    mt, single = result["prompts"]
    assert [t["turn"] for t in mt["turns"]] == [1, 2] and [t["turn"] for t in single["turns"]] == [1]
    tail = apply_chat_template(tiny_loaded.tokenizer, [{"role": "user", "content": recs[0].turns[1]}])
    for mode in ["ar", "ngram", "model", "hf-ar", "hf-prompt-lookup"]:
        first, second = (ids for ids, m, _ in timed if m == mode and ids[:3] == timed[0][0][:3])
        t1, t2 = mt["turns"][0]["modes"][mode], mt["turns"][1]["modes"][mode]
        # turn 2 is the chat so far with this mode's own reply, then the second user turn
        assert second[: len(first)] == first and len(second) == t2["prompt_tokens"] > t1["prompt_tokens"]
        assert second[-len(tail):] == tail
        assert t1["equal_to_baseline"] is True and t2["equal_to_baseline"] is True
        assert mt["modes"][mode]["tokens"] == t1["tokens"] + t2["tokens"]
        assert mt["modes"][mode]["seconds"] == pytest.approx(t1["seconds"] + t2["seconds"])
        # our modes keep the conversation's KV: turn 2 computes only what is new; the peers start afresh
        assert t1["prefill_reused_tokens"] == 0
        assert (t2["prefill_reused_tokens"] > 0) == (not mode.startswith("hf-"))
    assert set(result["by_turn"]) == {"1", "2"}
    assert result["by_turn"]["2"]["ar"]["tokens"] == mt["turns"][1]["modes"]["ar"]["tokens"]
    first_turns = mt["turns"][0]["modes"]["ar"]["tokens"] + single["modes"]["ar"]["tokens"]
    assert result["by_turn"]["1"]["ar"]["tokens"] == first_turns
    assert result["config"]["turns"] == 2


def test_a_conversations_later_turns_keep_its_proposer(tiny_loaded, tiny_draft_loaded, monkeypatch) -> None:
    """A conversation keeps its proposer across turns as it keeps its sequence: the draft model's
    second turn reads the turn's new tokens, not the whole conversation again (as the drafter's
    parked sessions do through the stack); the output still equals plain decoding's."""
    from tandem.engine.speculation import proposers

    rec = PromptRecord(id="mt", dataset="mt", category=None, system="be kind",
                       turns=["the cat and the dog and the cat " * 6, "one two one two one two"])
    engine = Engine(tiny_loaded, tiny_draft_loaded, SpecConfig(adaptive=False, max_draft_tokens=4))  # always drafts
    target = EngineTarget(engine, tiny_loaded.tokenizer)
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    conv, plain = target.conversation(rec, "model"), target.conversation(rec, "ar")
    conv.turn(0, sampling), plain.turn(0, sampling)
    kept = conv.proposer
    fed: list[int] = []
    real = proposers._DraftLM.feed
    monkeypatch.setattr(proposers._DraftLM, "feed", lambda self, tokens: fed.append(len(tokens)) or real(self, tokens))
    second = conv.turn(1, sampling)
    assert conv.proposer is kept and second.stats.drafted > 0
    assert second.stats.prefill_reused_tokens > 40
    assert max(fed) <= second.stats.prefill_computed_tokens + 12  # the new tokens (and the reply), not ~90
    assert second.token_ids == plain.turn(1, sampling).token_ids


def test_each_mode_learns_from_its_own_runs_only(tiny_loaded) -> None:
    """The modes of one bench share the engine and its cost curve, not their acceptance counts: a
    mode's controller must not start from what another mode's drafts taught (the hybrid read suffix
    mode's long blocks and looked better beside it than alone)."""
    rec = PromptRecord(id="r", dataset="d", category=None, system=None,
                       turns=["the cat and the dog and the cat and the dog and the cat " * 3])
    engine = Engine(tiny_loaded, None, SpecConfig(adaptive=False, max_draft_tokens=4))  # always drafts
    target = EngineTarget(engine, tiny_loaded.tokenizer)
    sampling = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ids, _ = target.prepare(rec)
    for mode in ("ngram", "suffix"):
        assert target.run(ids, sampling, mode, None).stats.drafted > 0
    learnt = {mode: {key[0] for key in counts.counts} for mode, counts in target.acceptance.items()}
    assert learnt["ngram"] == {"ngram"}
    assert learnt["suffix"] and all(name.startswith("suffix") for name in learnt["suffix"])
    assert not engine.acceptance.counts  # the engine's own counts were not touched


# --- the command ---------------------------------------------------------------------------------------


def test_bench_command_with_peers_turns_and_plots(tiny_loaded, tmp_path: Path) -> None:
    import torch
    from typer.testing import CliRunner

    from tandem.tools.cli import app

    model_dir = tmp_path / "tiny-llama"
    tiny_loaded.model.save_pretrained(str(model_dir))
    tiny_loaded.tokenizer.save_pretrained(str(model_dir))
    dataset = tmp_path / "mt.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question_id": 1, "category": "writing", "turns": ["the cat and the dog and the cat", "one two one two"]},
        {"question_id": 2, "category": "math", "turns": ["two plus two is four two plus two", "and three"]},
    ]))
    report, plots = tmp_path / "out.json", tmp_path / "plots"
    threads = torch.get_num_threads()
    try:
        res = CliRunner().invoke(app, [
            "bench", "--model", str(model_dir), "--dataset", str(dataset), "--max-new-tokens", "6", "--modes",
            "ar,ngram,hf-prompt-lookup", "--turns", "2", "--hf-lookup-tokens", "4", "--plot", str(plots),
            "--out", str(report), "--threads", "1",
        ], env={"COLUMNS": "200", "NO_COLOR": "1"})
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    result = json.loads(report.read_text())
    assert list(result["modes"]) == ["ar", "ngram", "hf-ar", "hf-prompt-lookup"]
    assert result["config"]["turns"] == 2 and result["config"]["hf_lookup_tokens"] == 4
    assert set(result["by_category"]) == {"writing", "math"} and set(result["by_turn"]) == {"1", "2"}
    assert all(len(p["turns"]) == 2 for p in result["prompts"])
    assert sorted(p.name for p in plots.iterdir()) == sorted(
        ["speedup.png", "acceptance_by_position.png", "accepted_length.png", "tokens_per_s.png"])
    assert "speedup by category" in res.stderr


def test_a_mode_that_drafted_almost_nothing_is_marked_and_tables_fit_80_columns(tiny_loaded) -> None:
    """A speculative mode that drafted under 3 tokens per reply did not speculate: its ratio to
    plain decoding is printed with that note (never as a speedup), in 80 columns, headers whole."""
    from tandem.tools.bench import DID_NOT_SPECULATE, speculated

    records = [PromptRecord(id=str(i), dataset="t", category=None, system=None, turns=[t])
               for i, t in enumerate(["the of and to a in is it", "one two three four five six"])]
    engine = Engine(tiny_loaded, spec=SpecConfig(max_draft_tokens=4))
    result = run_bench(engine, records, ["ar", "ngram"], 8, tokenizer=tiny_loaded.tokenizer, progress=False)
    s = result["modes"]["ngram"]
    assert s["drafted"] == s["drafted_per_reply"] * 2 and speculated(s) is (s["drafted_per_reply"] >= 3)
    assert "drafted_per_reply" not in result["modes"]["ar"]
    # Force the case: whatever the ratio, a mode with no drafts is labelled.
    s.update(drafted=0, drafted_per_reply=0.0, speculated=False, speedup_vs_ar=1.15)
    console = Console(file=io.StringIO(), width=80)
    console.print(format_table(result))
    text = console.file.getvalue()
    assert "1.15x" in text and DID_NOT_SPECULATE.split()[0] in text
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80


def test_bfcl_functions_as_api_tools_under_the_call_grammar(tiny_loaded, tmp_path: Path) -> None:
    """--tools required: a BFCL record's functions go to the model as the gateway renders tools (not
    as its tool-list text), every mode generates under the one-call grammar, and speculation stays
    lossless there; hf-* modes and a remote target are refused with the reason."""
    path = tmp_path / "BFCL_mini.json"
    fn = {"name": "math.area", "description": "Area of a shape.", "parameters": {
        "type": "dict", "properties": {"shape": {"type": "string"}, "size": {"type": "float"}}, "required": ["shape"]}}
    rows = [{"id": f"q{i}", "question": [[{"role": "user", "content": f"area of a square of side {i}?"}]],
             "function": [fn]} for i in range(2)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    records = load_prompts(path)
    assert records[0].functions[0]["parameters"]["properties"]["size"]["type"] == "number"  # BFCL's names mapped
    assert records[0].system_without_tools is None and "math.area" in records[0].system
    engine = Engine(tiny_loaded, spec=SpecConfig(adaptive=False, max_draft_tokens=4))
    as_text = run_bench(engine, records, ["ar", "ngram"], 24, tokenizer=tiny_loaded.tokenizer, progress=False)
    required = run_bench(engine, records, ["ar", "ngram"], 24, tokenizer=tiny_loaded.tokenizer, progress=False,
                         tools="required")
    assert required["config"]["tools"] == "required" and as_text["config"]["tools"] == "prompt"
    assert [p["prompt_tokens"] for p in required["prompts"]] != [p["prompt_tokens"] for p in as_text["prompts"]]
    assert required["modes"]["ngram"]["lossless"] == 1.0
    # the grammar was on: every reply is a prefix of one call object of the record's functions
    target = EngineTarget(engine, tiny_loaded.tokenizer, tools="required")
    rec = records[0]
    ids = target.context_ids(rec, to_chat(rec, 0))
    text = tiny_loaded.tokenizer.decode(
        target.run(ids, target.record_sampling(rec, SamplingParams(max_new_tokens=24)), "ar", None).token_ids)
    assert text.lstrip().startswith("{"), text
    with pytest.raises(ValueError, match="hf-"):
        run_bench(engine, records, ["ar", "hf-ar"], 8, tokenizer=tiny_loaded.tokenizer, progress=False, tools="required")
    with pytest.raises(ValueError, match="tools must be one of"):
        EngineTarget(engine, tiny_loaded.tokenizer, tools="sometimes")


def test_suffix_warm_feeds_later_prompts_never_the_measured_prompts_own_answer(tiny_loaded, tmp_path) -> None:
    """The same question twice (two records): warm, the second is drafted from the first's answer;
    the first, measured twice (repeats) and in two modes, never from its own (its figures equal a
    cold run's). Every mode stays lossless; the report says which store it ran with."""
    path = tmp_path / "twice.jsonl"
    q = "cat dog bird fish cow"
    path.write_text("".join(json.dumps({"id": i, "turns": [q]}) + "\n" for i in ("first", "again")))
    records = load_prompts(path)
    engine = Engine(tiny_loaded, spec=SpecConfig(adaptive=False, max_draft_tokens=8))
    run = lambda warm: run_bench(engine, records, ["ar", "ngram", "suffix"], 40, tokenizer=tiny_loaded.tokenizer,
                                 progress=False, repeats=2, suffix_warm=warm)
    warm, cold = run(True), run(False)
    assert warm["config"]["suffix_store"].startswith("warm") and cold["config"]["suffix_store"].startswith("cold")
    assert warm["config"]["suffix_store_end"]["responses"] == 2  # one per prompt: modes and repeats deduplicated
    for report in (warm, cold):
        assert all(s["lossless"] == 1.0 for s in report["modes"].values())
    first_w, again_w = (p["modes"]["suffix"] for p in warm["prompts"])
    first_c, again_c = (p["modes"]["suffix"] for p in cold["prompts"])
    assert (first_w["steps"], first_w["drafted"]) == (first_c["steps"], first_c["drafted"])
    assert again_c["steps"] == first_c["steps"]  # cold: the same question costs the same
    assert again_w["steps"] < first_w["steps"] / 2 and again_w["accepted"] >= 0.7 * again_w["tokens"]
    with pytest.raises(ValueError, match="suffix_warm runs in process"):
        run_bench(EngineTarget(engine, tiny_loaded.tokenizer), records, ["ar"], 4, progress=False, suffix_warm=True)


def test_first_turns_share_earlier_prompts_prefixes_never_a_sibling_modes(tiny_loaded, monkeypatch) -> None:
    """Three two-turn sessions behind one long system prompt (an agent's tool list): the first
    prompt prefills it whole in every mode, although its sibling modes ran the same prompt first;
    the later prompts' first turns copy it from an earlier prompt's conversation, the same length
    in every mode; every output equals the run without sharing, token for token."""
    system = " ".join(f"tool{i} takes a b and c" for i in range(12))
    recs = [PromptRecord(id=f"s{i}", dataset="agents", category=None, system=system,
                         turns=[f"call tool{i} with {i} {i + 1}", f"now tool{i + 3} please"]) for i in range(3)]
    engine = Engine(tiny_loaded, spec=SpecConfig(adaptive=False, max_draft_tokens=4))
    assert engine.runner.backend.shares_prefix
    modes = ["ar", "ngram", "suffix"]
    outputs: list[tuple[str, tuple[int, ...], list[int]]] = []  # (mode, context, output) of every generation
    real = EngineTarget.run

    def spy(self, ids, sampling, mode, sequence, proposer=None):
        res = real(self, ids, sampling, mode, sequence, proposer)
        outputs.append((mode, tuple(ids), res.token_ids))
        return res

    monkeypatch.setattr(EngineTarget, "run", spy)

    def run(share):
        outputs.clear()
        report = run_bench(engine, recs, modes, 12, tokenizer=tiny_loaded.tokenizer, progress=False, turns=2,
                           share_prefix=share)
        return report, sorted(outputs[len(modes):])  # after one warm-up per mode

    (shared, out_shared), (alone, out_alone) = run(None), run(False)  # None: on, since no peer mode runs
    assert len(out_shared) == 3 * 2 * len(modes) and out_shared == out_alone  # the same text, token for token
    assert shared["config"]["prefix_sharing"].startswith("on") and alone["config"]["prefix_sharing"].startswith("off")
    firsts = [apply_chat_template(tiny_loaded.tokenizer, to_chat(r, 0)) for r in recs]
    for i, (with_, without) in enumerate(zip(shared["prompts"], alone["prompts"])):
        common = max((common_prefix_len(firsts[i], firsts[j]) for j in range(i)), default=0)
        assert i == 0 or common >= 40, "the records share a long system prompt"
        for m in modes:
            t1 = with_["turns"][0]["modes"][m]
            assert t1["prefill_reused_tokens"] == (0 if i == 0 else common), (i, m)
            assert without["turns"][0]["modes"][m]["prefill_reused_tokens"] == 0
            assert with_["turns"][1]["modes"][m]["prefill_reused_tokens"] > t1["prompt_tokens"] / 2  # its own turn 1
            assert t1["equal_to_ar"] is True
    for report in (shared, alone):
        assert all(s["lossless"] == 1.0 for s in report["modes"].values())


def test_prefix_sharing_is_off_beside_the_peers_unless_asked(tiny_loaded, records) -> None:
    engine = Engine(tiny_loaded, spec=SpecConfig(adaptive=False))
    run = lambda share: run_bench(engine, records[:2], ["ar", "hf-ar"], 4, tokenizer=tiny_loaded.tokenizer,
                                  progress=False, share_prefix=share)
    assert run(None)["config"]["prefix_sharing"].startswith("off")  # the peers prefill every prompt whole
    assert run(True)["config"]["prefix_sharing"].startswith("on")
