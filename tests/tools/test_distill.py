"""`tandem distill` and what it makes: a reduced-vocabulary draft that loads through the normal path,
never proposes outside its head, keeps verification exact, and trains reproducibly across a resume.

The tiny random target stands in for SmolLM2 here (a real distillation of SmolLM2 takes minutes; its
figures are in docs/benchmarks.md); the exactness test on the embedded SmolLM2 is at the end."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.engine.model.loading import LoadedModel, check_same_tokenizer, load_model
from tandem.engine.model.paths import DRAFT_MANIFEST
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.scheduler.generate import Engine
from tandem.engine.speculation.proposers import DraftModelProposer, HybridProposer
from tandem.tools.distill import DistillConfig, build_draft, choose_head_vocab, distill, spread_layers

from smollm_fixture import smollm  # noqa: F401  (session fixture)

PROMPTS = [
    "write a python function that returns the sum of a list",
    "what is the name of the tool to call for the weather in paris",
    "list three animals and the sound each one makes",
    "how many days are there in two years",
    "give me a json object with a name and a value",
    "def add ( a , b ) : return a + b . now write mul",
]

TINY_CFG = dict(layers=1, vocab_top=96, tokens=240, max_new_tokens=24, gen_batch=3, epochs=2.0, batch_size=2,
                checkpoint_every=2, validation_fraction=0.2, lr=1e-3, warmup_steps=1, self_prompts=3,
                self_prompt_tokens=8)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def distilled(tiny_loaded, prompt_file, tmp_path_factory) -> tuple[dict, LoadedModel]:
    out = tmp_path_factory.mktemp("draft") / "tiny-draft"
    manifest = distill(tiny_loaded, [prompt_file], out, DistillConfig(**TINY_CFG), progress=False, keep_work=True)
    return manifest, load_model(str(out))


def test_the_draft_loads_through_load_model_and_shares_the_tokenizer(distilled, tiny_loaded) -> None:
    manifest, draft = distilled
    assert manifest["complete"] and manifest["train_tokens"] >= 1
    assert draft.head_vocab is not None and len(draft.head_vocab) == 96
    assert draft.vocab_size == 96  # the LM head has one row per head id
    assert draft.model.get_input_embeddings().weight.shape[0] == tiny_loaded.vocab_size  # reads any id
    check_same_tokenizer(tiny_loaded, draft)  # raises on a mismatch
    # the head starts as the target's rows for those ids and the embeddings are the target's, frozen
    assert torch.equal(draft.model.get_input_embeddings().weight, tiny_loaded.model.get_input_embeddings().weight)
    assert draft.tokenizer.get_vocab() == tiny_loaded.tokenizer.get_vocab()


def test_the_head_vocabulary_is_the_most_frequent_training_ids(distilled) -> None:
    manifest, draft = distilled
    ids = draft.head_vocab.tolist()
    assert ids == sorted(set(ids)) and 2 in ids  # sorted, unique, end-of-sequence always in
    assert 0 < manifest["head_coverage"] <= 1


def test_a_reduced_head_never_proposes_outside_its_set(distilled, tiny_loaded) -> None:
    _, draft = distilled
    allowed = set(draft.head_vocab.tolist())
    proposer = DraftModelProposer(draft, draft_top_k=8, vocab_limit=tiny_loaded.vocab_size)
    gen = torch.Generator().manual_seed(0)
    contexts = [list(range(5, 40)), [7, 7, 7, 9, 11], list(range(300, 340)), [400 + i % 7 for i in range(30)]]
    proposed = set()
    for ctx in contexts:
        greedy = proposer.propose(ctx, 6, SamplingParams(), None)
        sampled = proposer.propose(ctx, 6, SamplingParams(temperature=1.5), gen)
        proposed |= set(greedy.tokens) | set(sampled.tokens) | set(sampled.support.flatten().tolist())
        assert sampled.support_probs.sum(-1).allclose(torch.ones(6))
    assert proposed and proposed <= allowed
    # the same model with a full head would propose outside: the guard is the head, not luck
    full = DraftModelProposer(LoadedModel("full", "", tiny_loaded.model, tiny_loaded.tokenizer))
    outside = {t for ctx in contexts for t in full.propose(ctx, 6, SamplingParams(temperature=1.5), gen).tokens}
    assert outside - allowed


@pytest.mark.parametrize("strategy", [DraftStrategy.model, DraftStrategy.hybrid])
def test_greedy_output_equals_plain_decoding_with_the_distilled_draft(distilled, tiny_loaded, strategy) -> None:
    _, draft = distilled
    engine = Engine(tiny_loaded, draft, SpecConfig(strategy=strategy, max_draft_tokens=4, adaptive=False))
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in ([5, 6, 7, 8, 9, 5, 6, 7], list(range(100, 130)), [11, 12, 11, 12, 11, 12, 13]):
        plain = engine.generate(prompt, sampling, SpecConfig(strategy=DraftStrategy.none))
        spec = engine.generate(prompt, sampling)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.drafted > 0


def test_hybrid_stats_show_which_proposer_drafted(distilled, tiny_loaded) -> None:
    _, draft = distilled
    engine = Engine(tiny_loaded, draft, SpecConfig(strategy=DraftStrategy.hybrid, max_draft_tokens=4, adaptive=False))
    # a repetitive prompt gives context matches (suffix decoding's, in prompt lookup's place);
    # elsewhere the model drafts
    prompt = [20, 21, 22, 23, 24, 25] * 4 + [30, 31]
    result = engine.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    by = result.stats.by_proposer
    assert set(by) <= {"suffix", "model"} and by
    assert sum(c["drafted"] for c in by.values()) == result.stats.drafted
    assert sum(c["accepted"] for c in by.values()) == result.stats.accepted
    assert isinstance(engine.factory.build(SpecConfig(strategy=DraftStrategy.hybrid)), HybridProposer)


def test_hybrid_chooses_by_measured_value(distilled, tiny_loaded) -> None:
    """With the context matches (suffix decoding's, in prompt lookup's place) measured as always
    right and the model always wrong, the hybrid drafts from the match where the context matches;
    with the opposite record, with the model."""
    from tandem.engine.speculation.adaptive import AcceptanceCounts

    _, draft = distilled
    engine = Engine(tiny_loaded, draft, SpecConfig(strategy=DraftStrategy.hybrid, max_draft_tokens=4))
    for n in range(1, 10):  # known costs: the first step may already draft
        engine.runner.costs.observe(n, 0.01 * (1 + 0.1 * (n - 1)))
    prompt = [20, 21, 22, 23, 24, 25, 30, 31, 32, 20, 21]  # ends in a 2-token match
    for good, bad in (("suffix", "model"), ("model", "suffix")):
        engine.acceptance = AcceptanceCounts()
        for bucket in range(8):
            for _ in range(200):
                engine.acceptance.observe((good, bucket), 4, 4)
                engine.acceptance.observe((bad, bucket), 4, 0)
        gen = engine.start(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
        gen.step()
        assert set(gen.stats.by_proposer) == {good}, (good, gen.stats.by_proposer)
    # a long match wins outright: the model is not even asked (no draft step spent on it); with
    # suffix decoding it is suffix's offer alone (prompt lookup would look up the same match)
    long_match = [20, 21, 22, 23, 24, 25] * 3 + [20, 21]
    proposer = engine.factory.build(SpecConfig(strategy=DraftStrategy.hybrid))
    assert [o.proposer for o in proposer.offers(long_match)] == ["suffix"]
    engine.factory.hybrid_suffix = False  # the hybrid of prompt lookup and the model only
    proposer = engine.factory.build(SpecConfig(strategy=DraftStrategy.hybrid))
    assert [o.proposer for o in proposer.offers(long_match)] == ["ngram"]


def test_the_target_writes_prompts_of_its_own(tiny_loaded, distilled, tmp_path) -> None:
    """Self-written prompts: sampled from the target's own user turn, reproducible with the seed,
    and trained on as one more prompt source."""
    from tandem.tools.distill import SELF_PROMPTS_FILE, write_prompts

    cfg = DistillConfig(**{**TINY_CFG, "self_prompts": 5})
    first = write_prompts(tiny_loaded, cfg, progress=False)
    assert 0 < len(first) <= 5 and all(isinstance(t, str) and t.strip() == t and t for t in first)
    assert write_prompts(tiny_loaded, cfg, progress=False) == first
    assert write_prompts(tiny_loaded, DistillConfig(**{**TINY_CFG, "self_prompts": 5, "seed": 1}), progress=False) != first
    assert write_prompts(tiny_loaded, DistillConfig(**{**TINY_CFG, "self_prompts": 0}), progress=False) == []
    # a tokenizer without a chat template: the plain transcript's user turn
    plain_tok = copy.deepcopy(tiny_loaded.tokenizer)
    plain_tok.chat_template = None
    plain = dataclasses.replace(tiny_loaded, tokenizer=plain_tok)
    assert 0 < len(write_prompts(plain, cfg, progress=False)) <= 5
    # the distilled fixture's run wrote its own (kept for reading) and trained on replies to them
    manifest, draft = distilled
    written = [json.loads(line)["prompt"] for line in
               (Path(draft.path) / "work" / SELF_PROMPTS_FILE).read_text().splitlines()]
    assert manifest["self_prompts"] == 3 and 0 < len(written) <= 3
    teacher = torch.load(Path(draft.path) / "work" / "teacher.pt", weights_only=False)["seqs"]
    rendered = [apply_chat_template(tiny_loaded.tokenizer, [{"role": "user", "content": t}]) for t in written]
    assert any(s["ids"][: s["start"]] in rendered for s in teacher)


def test_a_complete_run_removes_its_large_work_files(tiny_loaded, prompt_file, tmp_path) -> None:
    from tandem.tools.distill import CHECKPOINT_FILE, TEACHER_FILE

    out = tmp_path / "draft"
    manifest = distill(tiny_loaded, [prompt_file], out, DistillConfig(**TINY_CFG), progress=False)
    assert manifest["complete"] and (out / "config.json").exists()
    assert not (out / "work" / TEACHER_FILE).exists() and not (out / "work" / CHECKPOINT_FILE).exists()
    assert (out / "work" / "config.json").exists()  # the small files stay for reading


def test_training_resumes_to_the_same_result(tiny_loaded, prompt_file, tmp_path) -> None:
    cfg = DistillConfig(**TINY_CFG)
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    distill(tiny_loaded, [prompt_file], straight, cfg, progress=False)
    partial = distill(tiny_loaded, [prompt_file], interrupted, cfg, progress=False, stop_after=2)
    assert not partial["complete"] and not (interrupted / DRAFT_MANIFEST).exists()
    with pytest.raises(FileExistsError, match="--resume"):
        distill(tiny_loaded, [prompt_file], interrupted, cfg, progress=False)
    resumed = distill(tiny_loaded, [prompt_file], interrupted, cfg, progress=False, resume=True)
    assert resumed["complete"] and resumed["training"]["steps"] > 2
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(interrupted / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # and training moved the weights: the result is not the initialisation
    init = build_draft(tiny_loaded, torch.tensor(json.loads((straight / DRAFT_MANIFEST).read_text())["head_vocab"]), cfg)
    assert not torch.equal(init.model.layers[0].mlp.down_proj.weight, a["model.layers.0.mlp.down_proj.weight"])


def test_a_resume_with_other_settings_is_refused(tiny_loaded, prompt_file, tmp_path) -> None:
    out = tmp_path / "d"
    distill(tiny_loaded, [prompt_file], out, DistillConfig(**TINY_CFG), progress=False, stop_after=2)
    with pytest.raises(ValueError, match="other settings"):
        distill(tiny_loaded, [prompt_file], out, DistillConfig(**{**TINY_CFG, "lr": 2e-3}), progress=False, resume=True)


def test_head_vocabulary_choice() -> None:
    from tandem.tools.distill import TeacherSeq

    seq = TeacherSeq(ids=[5, 5, 5, 9, 9, 7, 3], start=3, top_ids=torch.zeros(4, 1, dtype=torch.int32),
                     top_probs=torch.ones(4, 1, dtype=torch.float16))
    assert choose_head_vocab([seq], 3, 20, always=[2]).tolist() == [2, 5, 9]
    assert choose_head_vocab([seq], 6, 20, always=[2]).tolist() == [0, 2, 3, 5, 7, 9]  # filled deterministically
    assert spread_layers(30, 2) == (0, 29) and spread_layers(30, 1) == (0,) and spread_layers(30, 4) == (0, 10, 19, 29)


def test_distill_and_generate_from_the_cli(tiny_dir, prompt_file, tmp_path, monkeypatch) -> None:
    from tandem.tools.cli import app

    target_dir = tiny_dir
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    runner = CliRunner()
    # no draft yet: modes that need one say how to make it
    res = runner.invoke(app, ["generate", "--model", str(target_dir), "--prompt", "hi", "--draft", "hybrid", "--json"])
    assert res.exit_code == 2 and "tandem distill" in res.output
    res = runner.invoke(app, ["distill", "--target", str(target_dir), "--prompts", str(prompt_file), "--layers", "1",
                              "--vocab-top", "80", "--tokens", "120", "--epochs", "1", "--self-prompts", "2",
                              "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert "head rows" in res.output
    # the default draft is found in the cache for modes model and hybrid
    res = runner.invoke(app, ["generate", "--model", str(target_dir), "--prompt", "the of and the of and",
                              "--draft", "hybrid", "--json", "-n", "16", "--threads", "1"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert "by_proposer" in out and len(out["token_ids"]) >= 1


@pytest.mark.slow
def test_a_reduced_head_draft_keeps_smollm2_exact(smollm) -> None:
    """Greedy output with a reduced-vocabulary draft built from SmolLM2 (untrained: its acceptance is
    low, which exercises rejection) equals plain decoding, for the model and hybrid proposers."""
    from tandem.engine.model.tokenizer import apply_chat_template
    from tandem.tools.datasets import dev_set, load_prompts, to_chat

    head_vocab = torch.arange(0, 49152, 6)  # every sixth id: many of the target's tokens are outside
    cfg = DistillConfig(layers=2)
    model = build_draft(smollm, head_vocab, cfg).eval()
    draft = LoadedModel("smollm-reduced", "", model, smollm.tokenizer, head_vocab=head_vocab)
    engine = Engine(smollm, draft, SpecConfig(strategy=DraftStrategy.model, max_draft_tokens=4, adaptive=False))
    sampling = SamplingParams(max_new_tokens=32)
    recs = load_prompts(dev_set("mt_bench"), 2) + load_prompts(dev_set("humaneval"), 1)
    for rec in recs:
        ids = apply_chat_template(smollm.tokenizer, to_chat(rec, 0))
        plain = engine.generate(ids, sampling, SpecConfig(strategy=DraftStrategy.none)).token_ids
        for strategy in (DraftStrategy.model, DraftStrategy.hybrid):
            spec = engine.generate(ids, sampling, SpecConfig(strategy=strategy, max_draft_tokens=4, adaptive=False))
            assert spec.token_ids == plain, (rec.id, strategy)
