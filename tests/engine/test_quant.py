"""GGUF-quantized weights run as stored (tandem/engine/quant.c, quant.py): the file's blocks read as
llama.cpp's own Python package (gguf) reads them, the kernel against dequantize-then-matmul, the
row-invariance the lossless rule leans on, and greedy equality of speculative and plain decoding
with a quantized target (tiny models quantized here, and the embedded SmolLM2 Q4_1 file).

The kernel is built with the host's C compiler at first use and only for a CPU with AVX-512;
elsewhere a GGUF target is dequantized to float32 (tested in test_gemv.py's no-compiler run).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tandem.engine import quant
from tandem.engine.config import SamplingParams, SpecConfig
from tandem.engine.llama import NativeLlama
from tandem.engine.models import LoadedModel, ModelError, apply_chat_template, load_model
from tandem.engine.quant import QuantizedLinears, QuantizedWeight, QuantRows
from tandem.engine.spec import Engine
from smollm_fixture import smollm  # noqa: F401 (fixture)

needs_kernel = pytest.mark.skipif(quant.library() is None, reason="no C compiler or no AVX-512 here: not offered")
gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("kind", quant.KINDS)
def test_gguf_blocks_read_as_llama_cpps_package_reads_them(kind) -> None:
    """Raw blocks made by gguf's own quantizer (a port of llama.cpp's reference), read by us and
    by gguf's dequantizer: the same weights. Our quantizer gives the same blocks, bit for bit."""
    gen = np.random.default_rng(1)
    w = (gen.standard_normal((24, 96)) * 0.05).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(w, qtype)  # [24, 3 * block bytes] uint8
    ours = QuantRows.from_gguf(kind, raw, 96)
    theirs = gguf.quants.dequantize(raw, qtype)  # [24, 96] float32
    np.testing.assert_allclose(ours.dequantize().numpy(), theirs, rtol=0, atol=1e-7)
    mine = QuantRows.quantize(torch.from_numpy(w), kind)
    assert torch.equal(mine.q, ours.q) and torch.equal(mine.d, ours.d) and torch.equal(mine.m, ours.m)


def test_quantized_rows_refuse_what_they_cannot_hold() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantRows.quantize(torch.randn(4, 40), "Q8_0")
    with pytest.raises(ValueError, match="kinds"):
        QuantRows.quantize(torch.randn(4, 64), "Q5_K")
    with pytest.raises(ValueError, match="uint8"):
        QuantRows.from_gguf("Q4_1", np.zeros((4, 30), np.uint8), 64)
    a, b = QuantRows.quantize(torch.randn(4, 64), "Q8_0"), QuantRows.quantize(torch.randn(4, 64), "Q4_1")
    with pytest.raises(ValueError, match="kinds"):
        QuantRows.cat([a, b])


@needs_kernel
@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("out_features, in_features", [(40, 64), (33, 96), (7, 32), (576, 1536)])
def test_the_kernel_matches_dequantize_then_matmul(kind, out_features, in_features) -> None:
    """Odd output counts (a masked store), one panel, fewer outputs than threads; every row count
    of a decode or verification block and a prefill's."""
    gen = torch.Generator().manual_seed(out_features)
    rows = QuantRows.quantize(torch.randn(out_features, in_features, generator=gen) * 0.05, kind)
    weight = QuantizedWeight(rows)
    ref_w = rows.dequantize()  # [out, in]
    for n in (*range(1, 18), 32, 75):
        x = torch.randn(n, in_features, generator=gen)  # [n, in]
        y = weight(x)
        assert y.shape == (n, out_features) and y.dtype == torch.float32
        torch.testing.assert_close(y, F.linear(x, ref_w), rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("kind", quant.KINDS)
def test_a_rows_result_does_not_depend_on_its_block_or_the_threads(kind) -> None:
    """Bit for bit, which is what lets plain decoding and verification share the target's numbers."""
    gen = torch.Generator().manual_seed(7)
    weight = QuantizedWeight(QuantRows.quantize(torch.randn(200, 128, generator=gen), kind))
    x = torch.randn(29, 128, generator=gen)
    block = weight(x)
    threads = torch.get_num_threads()
    try:
        for r in range(29):
            torch.set_num_threads(1 + r % 2)
            assert torch.equal(weight(x[r : r + 1]), block[r : r + 1]), r
            assert torch.equal(weight(x[: r + 1])[r], block[r]), r
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_bad_activations_are_refused_not_read() -> None:
    weight = QuantizedWeight(QuantRows.quantize(torch.randn(16, 64), "Q4_0"))
    for bad in (torch.randn(2, 32), torch.randn(2, 64, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"\[n, 64\]"):
            weight(bad)


def quantize_model(loaded: LoadedModel, kind: str, head_kind: str = "Q8_0") -> LoadedModel:
    """The test's own quantized target: every linear weight of a tiny model in `kind`, the head in
    `head_kind` (as the embedded file has Q4_1 layers and a Q8_0 head)."""
    layers = []
    for layer in loaded.model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        q = lambda *ws: QuantRows.quantize(torch.cat([w.weight for w in ws]), kind)  # noqa: E731
        layers.append({"wqkv": q(att.q_proj, att.k_proj, att.v_proj), "wo": q(att.o_proj),
                       "wgu": q(mlp.gate_proj, mlp.up_proj), "wdown": q(mlp.down_proj)})
    head = QuantRows.quantize(loaded.model.get_output_embeddings().weight, head_kind)
    return LoadedModel(model_id=f"{loaded.model_id}-{kind}", path="", model=loaded.model,
                       tokenizer=loaded.tokenizer, quantized=QuantizedLinears("test", layers, head))


@needs_kernel
@pytest.mark.parametrize("kind", quant.KINDS)
def test_greedy_speculation_equals_plain_decoding_with_a_quantized_target(kind, tiny_loaded, tiny_draft_loaded) -> None:
    from test_engine import _contexts

    target = quantize_model(tiny_loaded, kind)
    engine = Engine(target, tiny_draft_loaded)
    impl = engine.runner.backend.impl
    assert impl.quantized_only and impl.gemm_plan is None and engine.runner.precision == "GGUF " + " + ".join(
        dict.fromkeys([kind, "Q8_0"]))
    float_engine = Engine(tiny_loaded)
    sampling = SamplingParams(max_new_tokens=40)
    differs = 0
    for name, ctx in _contexts(tiny_loaded.tokenizer).items():
        plain = engine.generate(ctx, sampling, SpecConfig(strategy="none")).token_ids
        for strategy in ("ngram", "model", "hybrid"):
            res = engine.generate(ctx, sampling, SpecConfig(strategy=strategy, max_draft_tokens=8))
            assert res.token_ids == plain, (kind, name, strategy)
        differs += plain != float_engine.generate(ctx, sampling, SpecConfig(strategy="none")).token_ids
    # the quantized model is another model: on random weights its greedy text parts from float32's
    assert differs > 0


@needs_kernel
@pytest.mark.slow
def test_the_embedded_gguf_runs_quantized_and_speculation_equals_plain(smollm) -> None:
    """The default target as a user gets it (precision auto): the file's Q4_1 layers and Q8_0 head
    kept, the same weights transformers dequantizes (exactly), and a long greedy generation with
    speculation equal to plain decoding of that quantized model."""
    loaded = load_model("default", progress=False)
    assert loaded.quantized is not None and loaded.quantized.describe == "GGUF Q4_1 + Q8_0"
    base = smollm.model.model  # the float32 model from the same file
    layer = base.layers[3]
    q, k, v = (p.weight for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
    assert torch.equal(loaded.quantized.layers[3]["wqkv"].dequantize(), torch.cat([q, k, v]))  # Q/K rows in HF order
    assert torch.equal(loaded.quantized.head.dequantize(), smollm.model.get_output_embeddings().weight)
    engine = Engine(loaded)
    assert engine.runner.precision == "GGUF Q4_1 + Q8_0" and engine.runner.backend.impl.batch_invariant
    ctx = apply_chat_template(loaded.tokenizer, [{"role": "user", "content": (
        "Write a Python class for a bank account with deposit, withdraw and balance methods, then the same "
        "class again with type hints.")}])
    sampling = SamplingParams(max_new_tokens=96)
    plain = engine.generate(ctx, sampling, SpecConfig(strategy="none")).token_ids
    res = engine.generate(ctx, sampling, SpecConfig(strategy="ngram", adaptive=False, max_draft_tokens=8))
    assert res.token_ids == plain and res.stats.accepted > 0


def test_precision_is_checked_at_the_edge(tiny_dir) -> None:
    with pytest.raises(ModelError, match="unknown precision"):
        load_model("default", precision="int3", progress=False)
    with pytest.raises(ModelError, match="not a GGUF file"):
        load_model(str(tiny_dir), precision="gguf", progress=False)
    assert load_model(str(tiny_dir), progress=False).quantized is None  # auto: a float checkpoint stays float


@needs_kernel
def test_a_verifier_says_its_precision_and_serves_the_quantized_target(tiny_loaded) -> None:
    """Over real gRPC: GetInfo names what the output is lossless against, and a greedy request
    with speculation equals in-process plain decoding of the quantized target (not the float one)."""
    import grpc

    from tandem.services.verifier.core import VerifierCore
    from tandem.services.verifier.server import build_server
    from tandem.services.verifier.settings import VerifierSettings
    from tandem.serving.protoconv import verifier_record_from_proto
    from tandem.serving.residency import VerifierRecord
    from tandem.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

    target = quantize_model(tiny_loaded, "Q4_1")
    ctx = [5, 17, 42, 99, 17, 42, 7, 250, 17, 42, 99, 3, 11]
    expected = Engine(target).generate(ctx, SamplingParams(max_new_tokens=24), SpecConfig(strategy="none")).token_ids
    core = VerifierCore(VerifierSettings(verifier_id="v-q", port=0, kv_capacity_tokens=4096), target)
    server, port, _ = build_server(core)
    server.start()
    core.start(f"127.0.0.1:{port}")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        info = stub.GetInfo(verifier_pb2.InfoRequest(), timeout=5)
        assert info.precision == "GGUF Q4_1 + Q8_0"
        # as the gateway reads it (GetInfo poll, or the Redis registration) for ModelInfo / /v1/models
        rec = verifier_record_from_proto(info, f"127.0.0.1:{port}")
        assert rec.precision == "GGUF Q4_1 + Q8_0"
        assert VerifierRecord.from_hash(rec.verifier_id, rec.to_hash()).precision == "GGUF Q4_1 + Q8_0"
        tokens = []
        for msg in stub.Generate(verifier_pb2.SessionGenerateRequest(
                context_ids=ctx, sampling=common_pb2.SamplingParams(max_new_tokens=24),
                speculation=common_pb2.SpeculationParams(strategy=common_pb2.DRAFT_STRATEGY_NGRAM)), timeout=30):
            tokens.extend(msg.token_ids)
        assert tokens == expected
    finally:
        channel.close()
        server.stop(None)
        core.stop()


def test_where_the_kernel_cannot_run_a_gguf_target_is_float32(monkeypatch) -> None:
    """auto falls back to the dequantized model (saying so in the log); gguf refuses, saying why."""
    monkeypatch.setattr(quant, "library", lambda: None)
    assert load_model("default", progress=False).quantized is None
    with pytest.raises(ModelError, match="needs the quantized CPU kernel"):
        load_model("default", progress=False, precision="gguf")
