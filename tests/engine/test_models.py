"""Model loading and pairing, and the embedded SmolLM2 end to end.

Fast tests use tiny random Llamas saved to disk. Tests marked `slow` use the embedded SmolLM2 (they
run by default; `-m "not slow"` leaves them out): its GGUF conversion, and the lossless property on
a real model and real prompts, where greedy speculative decoding must give plain decoding's tokens
exactly, for prompt lookup and for a real draft model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import EOS_ID, SPECIAL_TOKENS
from smollm_fixture import smollm, smollm_draft  # noqa: F401  (fixtures)
from tandem.contract.params import SamplingParams, SpecConfig
from tandem.contract.results import FinishReason
from tandem.engine.model import paths
from tandem.engine.model.loading import LoadedModel, check_same_tokenizer, convert_gguf, load_model
from tandem.engine.model.paths import EMBEDDED_ID, ModelError, embedded_gguf_path, resolve_model_path
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.scheduler.generate import Engine
from tandem.tools.datasets import PROMPTS_DIR, load_prompts, to_chat
from oracle import plain_generate

DATA = PROMPTS_DIR


def word_tokenizer(words: list[str]):
    """A word-level fast tokenizer over SPECIAL_TOKENS + `words`."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + words)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


# --- pairing a draft with a target ------------------------------------------------------------------


def test_same_tokenizer_passes(tiny_loaded, tiny_draft_loaded) -> None:
    check_same_tokenizer(tiny_loaded, tiny_draft_loaded)


def test_different_vocabularies_are_refused_naming_both_models(tiny_loaded, tiny_draft_loaded) -> None:
    other = LoadedModel(
        model_id="stranger",
        path="/models/stranger",
        model=tiny_draft_loaded.model,
        tokenizer=word_tokenizer(["alpha", "beta", "gamma"]),
    )
    with pytest.raises(ModelError) as err:
        check_same_tokenizer(tiny_loaded, other)
    message = str(err.value)
    assert "'stranger'" in message and "'tiny'" in message and "/models/stranger" in message
    assert "tokenizer" in message
    # Also when the words are the same but their ids are not.
    words = list(tiny_loaded.tokenizer.get_vocab())
    swapped = {i: w for w, i in tiny_loaded.tokenizer.get_vocab().items()}
    ordered = [swapped[i] for i in range(len(SPECIAL_TOKENS), len(words))]
    ordered[0], ordered[1] = ordered[1], ordered[0]
    shuffled = LoadedModel(
        model_id="shuffled", path="", model=tiny_draft_loaded.model, tokenizer=word_tokenizer(ordered)
    )
    assert set(shuffled.tokenizer.get_vocab()) == set(tiny_loaded.tokenizer.get_vocab())
    with pytest.raises(ModelError, match="shuffled"):
        check_same_tokenizer(tiny_loaded, shuffled)


def test_a_draft_head_wider_than_the_target_is_refused(tiny_loaded) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    wide = LlamaForCausalLM(
        LlamaConfig(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    )
    draft = LoadedModel(model_id="wide", path="", model=wide, tokenizer=tiny_loaded.tokenizer)
    with pytest.raises(ModelError, match="wide.*600"):
        check_same_tokenizer(tiny_loaded, draft)


# --- resolving and loading paths --------------------------------------------------------------------


def test_a_missing_path_is_a_clear_error(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelError, match="does not exist") as err:
        resolve_model_path(str(missing))
    assert str(missing) in str(err.value)
    with pytest.raises(ModelError, match="does not exist"):
        load_model(str(missing), progress=False)


def test_a_directory_without_config_or_gguf_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelError, match=r"no config\.json.*found 0"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelError, match="found 2"):
        resolve_model_path(str(tmp_path))


def test_paths_resolve_to_a_model_id_and_a_location(tmp_path) -> None:
    one = tmp_path / "ggufdir"
    one.mkdir()
    (one / "Tiny-Q4.gguf").write_bytes(b"")
    assert resolve_model_path(str(one)) == ("Tiny-Q4", one / "Tiny-Q4.gguf")  # the directory's only GGUF
    hf = tmp_path / "my-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model_path(str(hf)) == ("my-model", hf)


def test_default_names_the_embedded_model() -> None:
    for value in ("default", "", None):
        model_id, path = resolve_model_path(value)
        assert model_id == EMBEDDED_ID and path == embedded_gguf_path() and path.suffix == ".gguf"
        assert path.stat().st_size > 50_000_000


def test_load_model_reads_a_saved_hf_directory(tiny_dir, tiny_loaded) -> None:
    loaded = load_model(str(tiny_dir), progress=False)
    assert loaded.model_id == "tiny-llama" and Path(loaded.path) == tiny_dir
    assert not loaded.model.training
    assert loaded.vocab_size == 512 and loaded.max_context == 512 and loaded.eos_token_ids == [EOS_ID]
    check_same_tokenizer(tiny_loaded, loaded)  # the saved tokenizer is the same vocabulary
    messages = [{"role": "user", "content": "the cat is on the mat"}]
    ids = apply_chat_template(loaded.tokenizer, messages)
    assert ids == apply_chat_template(tiny_loaded.tokenizer, messages)  # chat template kept
    with torch.inference_mode():
        x = torch.tensor([ids])
        torch.testing.assert_close(loaded.model(x).logits, tiny_loaded.model(x).logits, atol=0, rtol=0)


def test_load_model_refuses_a_broken_directory(tmp_path) -> None:
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"}')  # no weights, no tokenizer
    with pytest.raises(ModelError, match="cannot load a causal LM from .*broken"):
        load_model(str(bad), progress=False)


def test_chat_template_fallback_without_a_template() -> None:
    tok = word_tokenizer(["user", "assistant", ":", "hello"])
    ids = apply_chat_template(tok, [{"role": "user", "content": "hello"}])
    assert tok.decode(ids) == "user : hello assistant :"


# --- the embedded SmolLM2 ---------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_default_loads_from_its_converted_cache(smollm) -> None:
    assert smollm.model_id == EMBEDDED_ID
    path = Path(smollm.path)
    assert (path / "config.json").exists() and any(path.glob("*.safetensors"))
    assert smollm.vocab_size == 49152 and smollm.eos_token_ids
    assert smollm.tokenizer.chat_template
    ids = apply_chat_template(smollm.tokenizer, [{"role": "user", "content": "What is 2 + 2?"}])
    assert "What is 2 + 2?" in smollm.tokenizer.decode(ids)
    # A cached conversion is reused: converting again returns at once, without rewriting.
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert convert_gguf(embedded_gguf_path(), progress=False) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


@pytest.mark.slow
def test_convert_gguf_writes_a_loadable_directory(tmp_path, smollm) -> None:
    """A real conversion (~20 s) into a fresh directory: complete, renamed into place, and the same
    weights as the cached conversion that `load_model("default")` uses."""
    out = tmp_path / "smollm2"
    assert convert_gguf(embedded_gguf_path(), out, progress=False) == out
    assert (out / "config.json").exists() and any(out.glob("*.safetensors"))
    assert not list(tmp_path.glob("smollm2.partial*")), "no temporary directory is left behind"
    converted = load_model(str(out), progress=False)
    check_same_tokenizer(smollm, converted)
    x = torch.tensor([apply_chat_template(smollm.tokenizer, [{"role": "user", "content": "Hello there"}])])
    with torch.inference_mode():
        torch.testing.assert_close(converted.model(x).logits, smollm.model(x).logits, atol=1e-5, rtol=1e-5)


REAL_PROMPTS = {  # one prompt of each development set (their first record)
    "HumanEval": "HumanEval.jsonl",
    "GSM8K": "gsm8k_question.jsonl",
    "MT-Bench": "mt_bench_question.jsonl",
    "BFCL": "bfcl/BFCL_v4_simple_python.json",
}
REAL_TOKENS = 48


@pytest.mark.slow
def test_greedy_speculation_on_smollm2_equals_plain_decoding(smollm, smollm_draft) -> None:
    """On real prompts, token for token: plain decoding (strategy none) == HF `generate` == prompt
    lookup (adaptive, on measured costs) == the 4-layer draft model (fixed blocks of 3, so every step
    verifies drafts that are mostly wrong: rejection and rollback at nearly every step) == suffix
    decoding (fixed blocks, a store fed by the earlier prompts' answers) == the hybrid of all three."""
    check_same_tokenizer(smollm, smollm_draft)
    from tandem.engine.speculation.suffix import SuffixStore

    engine = Engine(smollm, smollm_draft)
    engine.factory.suffix_store = SuffixStore()  # suffix and hybrid: later prompts draft from earlier answers too
    sampling = SamplingParams(max_new_tokens=REAL_TOKENS)
    eos = set(smollm.eos_token_ids)
    specs = {
        "ngram": SpecConfig(strategy="ngram"),
        "model": SpecConfig(strategy="model", adaptive=False, max_draft_tokens=3),
        "suffix": SpecConfig(strategy="suffix", adaptive=False, max_draft_tokens=6),
        "hybrid": SpecConfig(strategy="hybrid"),
    }
    accepted = {name: 0 for name in specs}
    for dataset, file in REAL_PROMPTS.items():
        record = load_prompts(DATA / file, 1)[0]
        ctx = apply_chat_template(smollm.tokenizer, to_chat(record, 0))
        plain = engine.generate(ctx, sampling, SpecConfig(strategy="none"))
        assert plain.stats.drafted == 0 and len(plain.token_ids) > 0
        if plain.finish_reason == FinishReason.length:
            assert len(plain.token_ids) == REAL_TOKENS
        assert plain.token_ids == plain_generate(smollm.model, ctx, REAL_TOKENS, eos), f"{dataset}: HF generate"
        for name, spec in specs.items():
            res = engine.generate(ctx, sampling, spec)
            assert res.token_ids == plain.token_ids, f"{dataset}: {name} differs from plain decoding"
            assert res.finish_reason == plain.finish_reason
            accepted[name] += res.stats.accepted
            if name == "model":  # fixed blocks: every step drafts, but a last one with no room left
                assert res.stats.spec_steps >= res.stats.steps - 1
    # Speculation was active, or this test would pass with it switched off.
    assert accepted["ngram"] > 0 and accepted["model"] > 0 and accepted["suffix"] > 0, accepted


def test_conversion_cache_is_keyed_by_content_not_path(tmp_path, monkeypatch) -> None:
    """The same GGUF file in two virtualenvs (two paths) converts once; another file does not
    share its cache. The digest is remembered, and recomputed when the file changes."""

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    a, b, c = (tmp_path / d / "m.gguf" for d in ("venv1", "venv2", "venv3"))
    for path, data in ((a, b"same weights"), (b, b"same weights"), (c, b"other weights")):
        path.parent.mkdir()
        path.write_bytes(data)
    assert paths.gguf_cache_for(a) == paths.gguf_cache_for(b) != paths.gguf_cache_for(c)
    assert paths.gguf_cache_for(a).parent == tmp_path / "cache" / "models"
    before = paths.gguf_cache_for(a)
    a.write_bytes(b"new weights, new size")
    assert paths.gguf_cache_for(a) != before


def test_a_prebuilt_conversion_is_used_without_converting(tmp_path, monkeypatch) -> None:
    """TANDEM_PREBUILT (the image's read-only cache): a conversion of the same content there is
    what loads, the writable cache stays empty; another file's conversion is not taken for it."""
    from tandem.engine.model import loading as models

    gguf = tmp_path / "venv" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"weights")
    prebuilt = tmp_path / "prebuilt"
    monkeypatch.setenv("TANDEM_CACHE", str(prebuilt))  # as at build time: convert into it
    name = paths.gguf_cache_for(gguf).name
    (prebuilt / "models" / name).mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        (prebuilt / "models" / name / f).write_text("{}")
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "pod-cache"))
    monkeypatch.setenv("TANDEM_PREBUILT", f"{tmp_path / 'elsewhere'}:{prebuilt}")
    assert models.convert_gguf(gguf) == prebuilt / "models" / name  # returned at once: nothing converted
    assert not (tmp_path / "pod-cache" / "models" / name).exists()
    other = tmp_path / "venv" / "other.gguf"
    other.write_bytes(b"other weights")
    assert paths.gguf_cache_for(other).parent == tmp_path / "pod-cache" / "models"
