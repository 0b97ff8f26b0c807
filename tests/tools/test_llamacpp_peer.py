"""llama.cpp as a benchmark peer (tandem/tools/llamacpp.py): the real llama.cpp (llama-cpp-python,
the `peers` extra) on the embedded SmolLM2 GGUF file, beside our plain decoding of the same file,
and the clear refusals where it cannot run."""

from __future__ import annotations

import pytest

from tandem.contract.params import SamplingParams
from tandem.engine.scheduler.generate import Engine
from tandem.tools import llamacpp
from tandem.tools.bench import run_bench
from tandem.tools.datasets import PromptRecord

needs_llamacpp = pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed (pip install '.[peers]')")

RECORDS = [
    PromptRecord(id="a", dataset="t", category=None, system=None,
                 turns=["Write a Python function that returns the squares of a list of numbers."]),
    PromptRecord(id="b", dataset="t", category=None, system=None,
                 turns=["List three colours, one per line, then the same three again."]),
    # past llama.cpp's batch of 512 tokens (a prompt-lookup context once failed there)
    PromptRecord(id="c", dataset="t", category=None, system=None,
                 turns=["Repeat this list back: " + ", ".join(f"item {i}" for i in range(200))]),
]


def test_the_llamacpp_modes_need_a_gguf_model(tiny_loaded) -> None:
    with pytest.raises(ValueError, match="GGUF file"):
        run_bench(Engine(tiny_loaded), RECORDS[:1], ["ar", "llamacpp"], 4, tokenizer=tiny_loaded.tokenizer, progress=False)


def test_without_the_binding_the_modes_say_how_to_get_it(monkeypatch) -> None:
    import builtins

    real = builtins.__import__

    def no_llama_cpp(name, *args, **kwargs):
        if name.startswith("llama_cpp"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama_cpp)
    with pytest.raises(llamacpp.PeerUnavailable, match=r"pip install 'tandem\[peers\]'"):
        llamacpp.LlamaCppPeer("/nonexistent.gguf", n_ctx=64)


@needs_llamacpp
@pytest.mark.slow
def test_llamacpp_runs_beside_our_modes_on_the_same_file() -> None:
    """Both llama.cpp modes run on the same prompt ids as ours; the report carries the like-for-like
    ratio to llama.cpp's plain decoding and how often its greedy text equals ours (it need not:
    other kernels, other rounding), and says which llama.cpp ran."""
    from tandem.engine.model.loading import load_model

    target = load_model("default", progress=False)
    engine = Engine(target)
    result = run_bench(engine, RECORDS, ["ar", "ngram", "llamacpp", "llamacpp-lookup"], 24,
                       tokenizer=target.tokenizer, progress=False, sampling=SamplingParams(max_new_tokens=24))
    modes = result["modes"]
    assert modes["llamacpp"]["baseline"] == "llamacpp" and modes["llamacpp-lookup"]["baseline"] == "llamacpp"
    for m in ("llamacpp", "llamacpp-lookup"):
        assert modes[m]["tokens"] > 0 and modes[m]["tokens_per_s"] > 0
        assert 0.0 <= modes[m]["agreement_with_ar"] <= 1.0
    for m in ("ar", "ngram"):
        assert modes[m]["tokens_per_s_vs_llamacpp"] > 0
        assert modes[m]["lossless"] == 1.0  # ours against our own plain decoding, as always
    cfg = result["config"]["llamacpp"]
    assert cfg["llama_cpp_python"] and cfg["gguf"] == target.gguf_file and cfg["threads"] >= 1
    # llama.cpp decodes the same file: its text agrees with ours on at least one of these prompts
    assert modes["llamacpp"]["agreement_with_ar"] > 0
