"""`tandem determinism` (tandem/tools/determinism.py) over real processes: greedy chat requests sent
alone, then all at once beside another tenant's long prompts, an n > 1 request, seeded sampled
requests and a verifier killed mid-stream, every speculation strategy; every greedy output (and the
seeded plain sampled ones) must equal its idle run token for token.

On the tiny random Llama (float32, the default "invariant" GEMM mode) with TLS and two tenants'
API keys (3 rounds, a kill in the second), and on the embedded SmolLM2 at its default precision with a short mix: the reproduction
of issue 54 (5 of 24 greedy outputs differed on the code before it, 3 rounds of this mix).
"""

from __future__ import annotations

import json

import pytest

from tandem.tools.determinism import STRATEGIES, DeterminismConfig, run_determinism, table

PROMPTS = ("the answer is the answer is", "one two three one two three", "a b c a b c a b",
           "write a python function that returns the sum of a list", "name three colors and three animals")


def _check(report: dict, kills: int) -> None:
    summary = dict(table(report))
    g = report["greedy"]
    assert g["errors"] == 0, report["differences"]
    assert g["mismatches"] == 0, report["differences"]
    assert report["sampled_none"]["mismatches"] == 0, report["differences"]
    assert report["ok"], summary
    assert set(report["per_strategy"]) == set(STRATEGIES), report["per_strategy"]
    assert len(report["kills"]) == kills
    # the n > 1 request's choices were each compared with the one idle output
    assert g["compared"] == report["rounds"] * (report["config"]["streams"] + report["config"]["n_choices"])


@pytest.mark.slow
def test_the_same_tokens_idle_and_under_a_hostile_mix_tiny(tiny_dir, tiny_draft_loaded, tmp_path) -> None:
    out = tmp_path / "determinism.json"
    draft = tmp_path / "tiny-draft"
    tiny_draft_loaded.model.save_pretrained(str(draft))
    tiny_draft_loaded.tokenizer.save_pretrained(str(draft))
    report = run_determinism(DeterminismConfig(
        model=str(tiny_dir), draft_model=str(draft), rounds=3, streams=6, max_tokens=48, long_prompts=2, long_words=150, n_choices=2,
        kill_every=2, tls=True, api_keys=True, prompts=PROMPTS, verifier_threads=1, startup_timeout_s=120),
        out=out)
    assert json.loads(out.read_text())["greedy"] == report["greedy"]
    _check(report, kills=1)


@pytest.mark.slow
def test_the_embedded_model_gives_the_same_tokens_idle_and_under_load(tmp_path) -> None:
    """The default model and precision, as `tandem up` runs it: 8 chat streams sharing a system
    prompt, another tenant's long prompt, a verifier killed in the second round. The draft for
    hybrid is SmolLM2 cut to its first 4 layers (a real draft with the target's tokenizer)."""
    from smollm_fixture import DRAFT_LAYERS

    from tandem.engine.model.loading import load_model

    loaded = load_model("default", progress=False, precision="float32")
    model = loaded.model
    model.model.layers = model.model.layers[:DRAFT_LAYERS]
    model.config.num_hidden_layers = DRAFT_LAYERS
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:DRAFT_LAYERS]
    draft = tmp_path / "smollm-first4"
    model.save_pretrained(str(draft))
    loaded.tokenizer.save_pretrained(str(draft))
    del loaded, model
    report = run_determinism(DeterminismConfig(
        draft_model=str(draft), rounds=2, streams=8, max_tokens=24, long_prompts=1, long_words=300, n_choices=2, kill_every=2,
        api_keys=True, startup_timeout_s=300), out=tmp_path / "determinism.json")
    _check(report, kills=1)
    assert report["greedy"]["resumed"] >= 1  # the kill hit streams in flight, which resumed on the other verifier


def test_the_cli_refuses_unknown_strategies() -> None:
    from typer.testing import CliRunner

    from tandem.tools.cli import app

    res = CliRunner().invoke(app, ["determinism", "--strategies", "ngram,telepathy"])
    assert res.exit_code != 0 and "telepathy" in res.output
