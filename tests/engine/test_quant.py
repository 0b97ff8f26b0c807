"""GGUF-quantized weights run as stored (tandem/engine/native/quant.c, quant.py): the file's blocks read as
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

from tandem.contract.params import SamplingParams, SpecConfig
from tandem.engine.model.llama import NativeLlama
from tandem.engine.model.loading import LoadedModel, load_model
from tandem.engine.model.paths import ModelError
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.native import attend, quant
from tandem.engine.native.quant import QuantizedLinears, QuantizedWeight, QuantRows
from tandem.engine.scheduler.generate import Engine
from smollm_fixture import smollm  # noqa: F401 (fixture)

needs_kernel = pytest.mark.skipif(not quant.float_activations_available(),
                                  reason="no C compiler or no AVX-512 here: precision gguf-float is not offered")
needs_int8 = pytest.mark.skipif(not quant.int8_activations_available(),
                                reason="no C compiler or neither AVX-512 VNNI nor AVX2: precision gguf is not offered")
ARITHMETICS = [pytest.param("int8", marks=needs_int8), pytest.param("float32", marks=needs_kernel)]
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


def test_our_gguf_index_reads_what_llama_cpps_package_reads(tmp_path) -> None:
    """`quant.gguf_tensors` (a header walk and a memory map, 100x faster than gguf.GGUFReader on the
    embedded model's tokenizer metadata) against gguf.GGUFReader on a file written by gguf's
    writer: every quantized kind, a float tensor, a 3-d tensor, string and number arrays, an
    alignment other than the default, and scalars of several types. Same tensors, same raw blocks."""
    gen = np.random.default_rng(5)
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", 64)
    w.add_string("general.name", "tiny ünïcode")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "ccc" * 50] * 100)
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    w.add_int32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    for i, kind in enumerate(quant.KINDS):
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        raw = gguf.quants.quantize((gen.standard_normal((8 + i, 64)) * 0.1).astype(np.float32), qtype)
        w.add_tensor(f"blk.0.{kind}.weight", raw, raw_dtype=qtype)
    w.add_tensor("norm.weight", gen.standard_normal(64).astype(np.float32))
    raw3 = gguf.quants.quantize((gen.standard_normal((2, 3, 64))).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("experts.weight", raw3, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    meta, ours = quant.gguf_tensors(path)
    reader = gguf.GGUFReader(str(path))
    assert meta["general.architecture"] == "llama" and meta["general.name"] == "tiny ünïcode"
    assert meta["general.alignment"] == 64 and meta["llama.block_count"] == 2 and meta["tokenizer.ggml.add_bos_token"]
    assert set(ours) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        mine = ours[t.name]
        assert mine.type_id == int(t.tensor_type) and mine.shape == tuple(int(d) for d in t.shape), t.name
        if t.tensor_type.name in quant.KINDS:
            assert mine.kind == t.tensor_type.name
            assert np.array_equal(mine.raw, np.asarray(t.data).reshape(mine.raw.shape)), t.name
        else:
            assert mine.kind is None and mine.raw is None
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        quant.gguf_tensors(tmp_path / "not.gguf")


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


def int8_definition(rows: QuantRows, x: torch.Tensor) -> np.ndarray:
    """quant.c's int8-activation arithmetic written from its comment in numpy, in float64 after the
    activations' 8-bit rounding (which is float32, as in C): x `# [n, in]` -> `# [n, out]`."""
    n, k = x.shape
    out, blocks = rows.shape[0], k // 32
    xs = x.numpy().astype(np.float32).reshape(n, blocks, 32)
    dx = (np.abs(xs).max(-1) / np.float32(127)).astype(np.float32)  # [n, blocks]
    inv = np.divide(np.float32(1), dx, out=np.zeros_like(dx), where=dx != 0).astype(np.float32)
    xq = np.rint(xs * inv[..., None]).astype(np.int64)  # nearest-even, [n, blocks, 32]
    q = rows.q.numpy().astype(np.int64).reshape(out, blocks, 32)
    s = np.einsum("nbi,obi->nob", xq, q).astype(np.float64)  # exact integer dots [n, out, blocks]
    d, m = rows.d.numpy().astype(np.float64), rows.m.numpy().astype(np.float64)  # [out, blocks]
    sx = xq.sum(-1).astype(np.float64) * dx.astype(np.float64)  # [n, blocks]
    return (s * d[None] * dx.astype(np.float64)[:, None]).sum(-1) + sx @ m.T


@pytest.mark.parametrize("activations", ARITHMETICS)
@pytest.mark.parametrize("kind", quant.KINDS)
@pytest.mark.parametrize("out_features, in_features", [(40, 64), (33, 96), (7, 32), (576, 1536)])
def test_the_kernel_matches_its_reference(kind, out_features, in_features, activations) -> None:
    """Odd output counts (a masked store), one panel, fewer outputs than threads; every row count
    of a decode or verification block and a prefill's. float32 activations: dequantize-then-matmul
    within float rounding. int8 activations: the plain-C reference bit for bit, the arithmetic as
    written in numpy within float rounding, and dequantize-then-matmul within the 8-bit rounding of
    the activations (a relative error of about half a percent, here under 2%)."""
    gen = torch.Generator().manual_seed(out_features)
    rows = QuantRows.quantize(torch.randn(out_features, in_features, generator=gen) * 0.05, kind)
    weight = QuantizedWeight(rows, activations)
    ref_w = rows.dequantize()  # [out, in]
    for n in (*range(1, 18), 32, 75):
        x = torch.randn(n, in_features, generator=gen)  # [n, in]
        x[-1, :32] = 0  # a block of zeros: its scale is 0, nothing divides by it
        y = weight(x)
        assert y.shape == (n, out_features) and y.dtype == torch.float32
        if activations == "float32":
            torch.testing.assert_close(y, F.linear(x, ref_w), rtol=1e-4, atol=1e-4)
            continue
        assert torch.equal(y, quant.reference_int8(rows, x)), n
        np.testing.assert_allclose(y.numpy(), int8_definition(rows, x), rtol=1e-4, atol=1e-5)
        exact = F.linear(x, ref_w)
        assert (y - exact).norm() <= 0.02 * exact.norm()


@pytest.mark.parametrize("activations", ARITHMETICS)
@pytest.mark.parametrize("kind", quant.KINDS)
def test_a_rows_result_does_not_depend_on_its_block_or_the_threads(kind, activations) -> None:
    """Bit for bit, which is what lets plain decoding and verification share the target's numbers."""
    gen = torch.Generator().manual_seed(7)
    weight = QuantizedWeight(QuantRows.quantize(torch.randn(200, 128, generator=gen), kind), activations)
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


@needs_int8
def test_the_avx2_form_gives_the_same_bits() -> None:
    """The int8 arithmetic built for an AVX2 host without AVX-512 (-march=haswell: 16-bit pair sums
    and the sign trick instead of VNNI) runs here too, and must give this host's kernel's bits and
    the reference's: the target is the same model on every x86 host."""
    import ctypes

    from avx2_build import avx2_build

    lib = avx2_build(quant, "quantized GEMM kernel")
    assert quant.int8_isa(lib) == "AVX2" and not lib.tandem_quant_available()
    gen = torch.Generator().manual_seed(3)
    for kind in quant.KINDS:
        for out_features, in_features in ((37, 96), (200, 576)):
            rows = QuantRows.quantize(torch.randn(out_features, in_features, generator=gen) * 0.05, kind)
            weight = QuantizedWeight(rows, "int8")
            for n in (1, 3, 4, 9, 17):
                x = torch.randn(n, in_features, generator=gen)
                y = torch.empty(n, out_features)
                fn = lib.tandem_quant_rows_q4a if rows.q4 else lib.tandem_quant_rows_q8a
                fn(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(weight.q.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                   n, out_features, in_features, torch.get_num_threads())
                assert torch.equal(y, weight(x)), (kind, out_features, n)
                assert torch.equal(y, quant.reference_int8(rows, x)), (kind, out_features, n)


@needs_int8
def test_a_drafts_int8_weights_run_as_blocks_within_rounding() -> None:
    """A draft model's int8 weights (one scale per output) on the int8-activation kernel, as Q8_0
    blocks that all carry the row's scale: the int8 weights' product within the activations' 8-bit
    rounding, and the kernel a draft step chooses among those that run here by measurement."""
    from tandem.engine.model.llama import _Int8Weight
    from tandem.engine.native import panel

    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300, 576, generator=gen) * 0.05
    assert _Int8Weight(w).kernel in {"panel", "blocks", "torch"}  # measured
    key = (300, 576, torch.get_num_threads())
    _Int8Weight.CHOSEN[key] = "blocks"  # as if measured fastest
    try:
        lin = _Int8Weight(w)
    finally:
        del _Int8Weight.CHOSEN[key]
    assert lin.kernel == "blocks" and lin.q is None  # only the blocks are kept
    q, scale = panel.quantize_int8(w)
    exact_w = q.float() * scale.half().float()[:, None]  # [out, in]: the blocks keep the scale in float16
    for n in (1, 5):
        x = torch.randn(n, 576, generator=gen)
        exact = F.linear(x, exact_w)
        assert (lin(x) - exact).norm() <= 0.02 * exact.norm()


@needs_int8
def test_scales_float16_cannot_hold_are_refused() -> None:
    """The int8 layout keeps d and m in float16, as GGUF files do: other scales would be rounded
    silently, so they are refused."""
    rows = QuantRows.quantize(torch.randn(16, 64), "Q8_0")
    odd = QuantRows("Q8_0", rows.q, rows.d * (1 + 2**-15), rows.m)
    with pytest.raises(ValueError, match="float16"):
        QuantizedWeight(odd, "int8")
    if quant.float_activations_available():  # AVX-512 only: an AVX2 host has no float-activation layout
        QuantizedWeight(odd, "float32")  # the float-activation layout keeps float32 scales


@needs_kernel
def test_bad_activations_are_refused_not_read() -> None:
    weight = QuantizedWeight(QuantRows.quantize(torch.randn(16, 64), "Q4_0"))
    for bad in (torch.randn(2, 32), torch.randn(2, 64, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"\[n, 64\]"):
            weight(bad)


def quantize_model(loaded: LoadedModel, kind: str, head_kind: str = "Q8_0", activations: str = "int8") -> LoadedModel:
    """The test's own quantized target: every linear weight of a tiny model in `kind`, the head in
    `head_kind` (as the embedded file has Q4_1 layers and a Q8_0 head), run with `activations`."""
    layers = []
    for layer in loaded.model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        q = lambda *ws: QuantRows.quantize(torch.cat([w.weight for w in ws]), kind)  # noqa: E731
        layers.append({"wqkv": q(att.q_proj, att.k_proj, att.v_proj), "wo": q(att.o_proj),
                       "wgu": q(mlp.gate_proj, mlp.up_proj), "wdown": q(mlp.down_proj)})
    head = QuantRows.quantize(loaded.model.get_output_embeddings().weight, head_kind)
    return LoadedModel(model_id=f"{loaded.model_id}-{kind}", path="", model=loaded.model,
                       tokenizer=loaded.tokenizer, quantized=QuantizedLinears("test", layers, head, activations))


@pytest.mark.parametrize("activations", ARITHMETICS)
@pytest.mark.parametrize("kind", quant.KINDS)
def test_greedy_speculation_equals_plain_decoding_with_a_quantized_target(kind, activations, tiny_loaded,
                                                                          tiny_draft_loaded) -> None:
    from test_engine import _contexts

    target = quantize_model(tiny_loaded, kind, activations=activations)
    engine = Engine(target, tiny_draft_loaded)
    impl = engine.runner.backend.impl
    # a float16 cache where our attention kernel serves (AVX-512), as the verifier says to clients
    kv = ", float16 KV" if attend.serves(1, impl.head_dim, impl.dtype, impl.device) else ""
    assert impl.kv_dtype == (torch.float16 if kv else torch.float32)
    assert impl.quantized_only and impl.gemm_plan is None and engine.runner.precision == (
        f"GGUF {' + '.join(dict.fromkeys([kind, 'Q8_0']))}, {activations} activations{kv}")
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


@needs_int8
@pytest.mark.slow
def test_the_embedded_gguf_runs_quantized_and_speculation_equals_plain(smollm) -> None:
    """The default target as a user gets it (precision auto = gguf where VNNI runs): the file's Q4_1
    layers and Q8_0 head kept, the same weights transformers dequantizes (exactly), and a long greedy
    generation with speculation equal to plain decoding of that quantized model."""
    loaded = load_model("default", progress=False)
    assert loaded.quantized is not None and loaded.quantized.describe == "GGUF Q4_1 + Q8_0, int8 activations"
    base = smollm.model.model  # the float32 model from the same file
    layer = base.layers[3]
    q, k, v = (p.weight for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
    assert torch.equal(loaded.quantized.layers[3]["wqkv"].dequantize(), torch.cat([q, k, v]))  # Q/K rows in HF order
    assert torch.equal(loaded.quantized.head.dequantize(), smollm.model.get_output_embeddings().weight)
    engine = Engine(loaded)
    impl = engine.runner.backend.impl
    kv = ", float16 KV" if impl.kv_dtype == torch.float16 else ""
    assert engine.runner.precision == loaded.quantized.describe + kv and impl.batch_invariant
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
    with pytest.raises(ModelError, match="not a GGUF file"):
        load_model(str(tiny_dir), precision="gguf-float", progress=False)
    assert load_model(str(tiny_dir), progress=False).quantized is None  # auto: a float checkpoint stays float


@needs_int8
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
        said = "GGUF Q4_1 + Q8_0, int8 activations" + (
            ", float16 KV" if core.engine.runner.backend.impl.kv_dtype == torch.float16 else "")
        assert info.precision == said
        # as the gateway reads it (GetInfo poll, or the Redis registration) for ModelInfo / /v1/models
        rec = verifier_record_from_proto(info, f"127.0.0.1:{port}")
        assert rec.precision == said
        assert VerifierRecord.from_hash(rec.verifier_id, rec.to_hash()).precision == said
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
    monkeypatch.setattr(quant, "int8_activations_available", lambda: False)
    monkeypatch.setattr(quant, "float_activations_available", lambda: False)
    assert load_model("default", progress=False).quantized is None
    for precision in ("gguf", "gguf-float"):
        with pytest.raises(ModelError, match=f"precision '{precision}' runs on a float32 CPU model with its kernel"):
            load_model("default", progress=False, precision=precision)


@needs_kernel
def test_without_the_int8_kernel_auto_keeps_the_weights_with_float_activations(monkeypatch) -> None:
    """Where only the float-activation kernel runs, auto is gguf-float; gguf refuses and says why."""
    monkeypatch.setattr(quant, "int8_activations_available", lambda: False)
    loaded = load_model("default", progress=False)
    assert loaded.quantized is not None and loaded.quantized.describe == "GGUF Q4_1 + Q8_0, float32 activations"
    with pytest.raises(ModelError, match="AVX-512 VNNI or AVX2.*Use precision gguf-float or float32"):
        load_model("default", progress=False, precision="gguf")


@pytest.mark.parametrize("activations", ARITHMETICS)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_raw_layer_calls_give_the_checked_paths_bits(kind, activations, tiny_loaded, monkeypatch) -> None:
    """A quantized target's decode and verification forwards run their layers as raw calls on
    buffers of their own (llama._RawLayers); the logits equal the checked path's bit for bit, for a
    ragged batch (one token, a chain, a token tree) over caches of different lengths (short
    prefills take the raw calls too, so the caches themselves are compared through the logits)."""
    from tandem.engine.model import llama

    target = quantize_model(tiny_loaded, kind, activations=activations)
    native = NativeLlama(target.model, quantized=target.quantized)
    assert native.raw_layers
    ran = []
    real_run = llama._RawLayers.run
    monkeypatch.setattr(llama._RawLayers, "run", lambda self: ran.append(self.x.shape[0]) or real_run(self))
    gen = torch.Generator().manual_seed(0)
    ctx = [torch.randint(0, native.vocab, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    blocks = [[7], [3, 9, 11, 2, 5], [4, 6, 8, 1]]
    trees = [None, None, [-1, 0, 0, 1]]

    def run(raw: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(native, "raw_layers", raw)
        caches = [native.new_cache() for _ in ctx]
        for ids, cache in zip(ctx, caches):
            native.forward(ids, cache, all_logits=False)  # prefill: the path under test too
        return native.forward_batch(list(zip(blocks, caches)), trees=trees)

    raw = run(True)
    assert ran[-1] == sum(map(len, blocks)), "the batch's forward went through the raw calls"
    ran.clear()
    checked = run(False)
    assert ran == []
    for a, b in zip(raw, checked):
        assert torch.equal(a, b)


@pytest.mark.skipif(not attend.serves(1, 64, torch.float32, torch.device("cpu")),
                    reason="no AVX-512 attention kernel here: a GGUF target keeps a float32 cache")
def test_a_gguf_targets_cache_is_float16_rounded_once(tiny_loaded) -> None:
    """A GGUF target on our CPU kernels keeps its KV cache in float16 (half the bytes attention
    reads at long contexts): each key and value is its float32 value rounded once (layer 0's keys
    and values, which depend on the tokens only, equal the float32 cache's rounded, bit for bit,
    for a block on our kernels and a prompt piece beside it). That plain decoding and verification
    then see one model is tested with the rest of the quantized target (greedy speculation equals
    plain decoding, raw layer calls, prompt pieces: float16 by default where this runs). A float32
    cache stays available (`kv_dtype`); float16 is refused where nothing reads it."""
    target = quantize_model(tiny_loaded, "Q4_1")
    native = NativeLlama(target.model, quantized=target.quantized)
    wide = NativeLlama(target.model, quantized=target.quantized, kv_dtype=torch.float32)
    assert native.kv_dtype == torch.float16 and native.new_cache().k.dtype == torch.float16
    assert native.precision.endswith(", float16 KV") and not wide.precision.endswith("KV")
    assert 2 * native.kv_bytes_per_slot == wide.kv_bytes_per_slot
    assert NativeLlama(tiny_loaded.model).kv_dtype == torch.float32  # a float32 model: its own dtype
    with pytest.raises(ValueError, match="float32 model on a CPU"):
        NativeLlama(tiny_loaded.model, kv_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, native.vocab, (n,), generator=gen).tolist() for n in (5, attend.MAX_ROWS + 8)]
    half, full = [native.new_cache() for _ in ids], [wide.new_cache() for _ in ids]
    native.forward_batch(list(zip(ids, half)), [True, False])
    wide.forward_batch(list(zip(ids, full)), [True, False])
    for h, f, n in zip(half, full, map(len, ids)):
        assert torch.equal(h.k[0, :, :n].view(torch.int16), f.k[0, :, :n].half().view(torch.int16))
        assert torch.equal(h.v[0, :, :n].view(torch.int16), f.v[0, :, :n].half().view(torch.int16))


def test_a_verifiers_kv_budget_from_memory_counts_its_float16_cache(tiny_loaded, monkeypatch) -> None:
    """--kv-memory-fraction sizes the budget by what the forward's cache takes a token: a float16
    cache holds twice the tokens of the model's float32 in the same memory."""
    from tandem.services.verifier import core as vcore
    from tandem.services.verifier.settings import VerifierSettings

    target = quantize_model(tiny_loaded, "Q4_1")
    monkeypatch.setattr(vcore, "free_memory_bytes", lambda device: 1 << 30)
    settings = VerifierSettings(verifier_id="v-mem", port=0, kv_memory_fraction=0.5, kv_capacity_tokens=1 << 30)
    core = vcore.VerifierCore(settings, target)
    impl = core.engine.runner.backend.impl
    assert core.kv_capacity == (1 << 29) // impl.kv_bytes_per_slot
    if impl.kv_dtype == torch.float16:
        assert core.kv_capacity == 2 * ((1 << 29) // vcore.kv_bytes_per_token(target))


@pytest.mark.parametrize("activations", ARITHMETICS)
def test_a_prompt_piece_split_over_forwards_by_layers_gives_its_whole_bits(activations, tiny_loaded) -> None:
    """A prompt piece run through layers 0..a-1 in one forward, a..b-1 in the next and the rest in a
    third (beside decoding rows each time, as the step loop runs it) leaves the cache a whole
    piece leaves, bit for bit: the next token's logits are equal, and so are the decoding rows'
    beside it. Until its last layer the cache keeps its length; a split without the raw layer calls,
    with logits or without its residual stream is refused."""
    target = quantize_model(tiny_loaded, "Q4_1", activations=activations)
    native = NativeLlama(target.model, quantized=target.quantized)
    assert native.splits_layers
    L = native.n_layers
    gen = torch.Generator().manual_seed(4)
    before = torch.randint(0, native.vocab, (30,), generator=gen).tolist()
    piece = torch.randint(0, native.vocab, (3,), generator=gen).tolist()
    other_ctx = torch.randint(0, native.vocab, (12,), generator=gen).tolist()

    def fresh():
        held, other = native.new_cache(), native.new_cache()
        native.forward(before, held, all_logits=False)
        native.forward(other_ctx, other, all_logits=False)
        return held, other

    held, other = fresh()
    whole = native.forward_batch([([7], other), (piece, held)], [True, False])
    after_whole = native.forward([5, 6], held)
    held2, other2 = fresh()
    cuts = [(0, 1), (1, L - 1), (L - 1, L)] if L > 2 else [(0, 1), (1, L)]
    hidden, rows = None, []
    for i, (a, e) in enumerate(cuts):
        out = native.forward_batch([([7 + i], other2), (piece, held2)], [True, False], layers=[None, (a, e, hidden)])
        rows.append(out[0])
        if e < L:
            assert held2.length == len(before) and out[1].shape == (len(piece), native.hidden)
            hidden = out[1]
        else:
            assert out[1] is None and held2.length == len(before) + len(piece)
    assert torch.equal(native.forward([5, 6], held2), after_whole)
    assert torch.equal(rows[0], whole[0])  # a decoding row beside a split piece: its bits
    with pytest.raises(ValueError, match="residual stream"):
        native.forward_batch([(piece, native.new_cache())], [False], layers=[(1, L, None)])
    with pytest.raises(ValueError, match="without logits"):
        native.forward_batch([(piece, native.new_cache())], [True], layers=[(0, 1, None)])
    plain = NativeLlama(tiny_loaded.model)  # float32 weights: no raw layer calls
    assert not plain.splits_layers
    with pytest.raises(ValueError, match="raw layer calls"):
        plain.forward_batch([(piece, plain.new_cache())], [False], layers=[(0, 1, None)])


def test_the_step_loop_splits_a_long_prompts_pieces_by_layers_and_stays_lossless(tiny_tokenizer) -> None:
    """Where even min_piece tokens cost more than a step may (the budget under min_piece: here
    forced, as a long context makes it), the step loop runs the oldest long prompt's piece through
    a share of the layers per step, beside a streaming session: the stream keeps its steps, the
    piece's parts are recorded as fractions of its tokens, and both outputs are the target
    alone's (greedy), the prompt's also with its pieces split."""
    import threading

    from conftest import make_tiny_llama
    from tandem.services.verifier.core import VerifierCore
    from tandem.services.verifier.settings import VerifierSettings

    base = LoadedModel(model_id="tiny6", path="", model=make_tiny_llama(seed=2, num_layers=6), tokenizer=tiny_tokenizer)
    target = quantize_model(base, "Q8_0")
    core = VerifierCore(VerifierSettings(verifier_id="v-split", port=0, prefill_chunk_tokens=16,
                                         prefill_min_tokens=4), target)
    ex = core.executor
    assert ex.split_layers == 6
    real_next = ex.budget.next
    # a budget of 1.5 tokens beside decoding rows: a 4-token piece through ceil(6 x 1.5 / 4) = 3 layers
    ex.budget.next = lambda rows, decoding: 1.5 if rows else real_next(rows, decoding)
    gen = torch.Generator().manual_seed(9)
    ctx_a = torch.randint(10, 500, (20,), generator=gen).tolist()
    ctx_b = torch.randint(10, 500, (120,), generator=gen).tolist()
    sampling_a = SamplingParams(max_new_tokens=150, ignore_eos=True)
    sampling_b = SamplingParams(max_new_tokens=6, ignore_eos=True)
    none = SpecConfig(strategy="none")
    a_steps: list = []
    started = threading.Event()

    def stream_a() -> None:
        for item in core.generate("a", ctx_a, sampling_a, SpecConfig(strategy="ngram")):
            a_steps.append(item)
            started.set()

    t = threading.Thread(target=stream_a, daemon=True)
    t.start()
    started.wait(60)
    h0, before = len(ex.history), len(a_steps)
    b_items = []
    for item in core.generate("b", ctx_b, sampling_b, none):
        if not b_items:
            history, during = list(ex.history)[h0:], len(a_steps) - before
        b_items.append(item)
    t.join(120)
    halves = [p for rows, ps, _ in history if rows for p in ps if isinstance(p, float)]  # split parts: shares
    # 4 tokens x 3 of 6 layers; 119 prompt tokens run (the last one waits), so the tail is 3 x 3 of 6:
    # split as well, not run whole (a long prompt's tail costs what the rest costs)
    assert 2.0 in halves and set(halves) <= {2.0, 1.5}, history
    assert during >= 10, f"a streamed {during} steps during b's prefill"
    assert b_items[-1].token_ids == Engine(target).generate(ctx_b, sampling_b, none).token_ids
    assert a_steps[-1].token_ids == Engine(target).generate(ctx_a, sampling_a, none).token_ids


@pytest.mark.parametrize("activations", ARITHMETICS)
def test_a_prompt_piece_beside_decoding_rows_leaves_their_bits(activations, tiny_loaded, monkeypatch) -> None:
    """A step that carries a prompt piece longer than the attention kernel serves (its attention on
    torch's kernel) beside decoding rows still runs the raw calls, the decoding rows' logits equal
    the same rows' in a step without the piece bit for bit, and the piece's cache continues exactly
    as the same tokens prefilled alone."""
    from tandem.engine.model import llama
    from tandem.engine.native import attend

    target = quantize_model(tiny_loaded, "Q4_1", activations=activations)
    native = NativeLlama(target.model, quantized=target.quantized)
    ran = []
    real_run = llama._RawLayers.run
    monkeypatch.setattr(llama._RawLayers, "run", lambda self: ran.append(self.x.shape[0]) or real_run(self))
    gen = torch.Generator().manual_seed(1)
    ctx = [torch.randint(0, native.vocab, (n,), generator=gen).tolist() for n in (5, 23)]
    before_piece = torch.randint(0, native.vocab, (10,), generator=gen).tolist()
    piece = torch.randint(0, native.vocab, (attend.MAX_ROWS + 8,), generator=gen).tolist()
    blocks = [[7], [3, 9, 11]]

    def fresh():
        caches = [native.new_cache() for _ in ctx]
        for ids, cache in zip(ctx, caches):
            native.forward(ids, cache, all_logits=False)
        held = native.new_cache()
        native.forward(before_piece, held, all_logits=False)
        return caches, held

    caches, held = fresh()
    mixed = native.forward_batch(list(zip(blocks, caches)) + [(piece, held)], [True, True, False])
    assert ran[-1] == sum(map(len, blocks)) + len(piece), "the mixed step went through the raw calls"
    assert mixed[2] is None
    caches_alone, held_alone = fresh()
    alone = native.forward_batch(list(zip(blocks, caches_alone)))
    for a, b in zip(mixed[:2], alone):
        assert torch.equal(a, b)
    native.forward(piece, held_alone, all_logits=False)
    assert torch.equal(native.forward([5, 6], held), native.forward([5, 6], held_alone))


@pytest.mark.parametrize("activations", ARITHMETICS)
def test_a_batched_steps_sessions_attend_in_one_call_and_keep_their_bits(activations, tiny_loaded, monkeypatch) -> None:
    """A batched step of several sessions on the raw path attends for all of them in one kernel call
    a layer (`tandem_attend_many`), and each session's logits equal its block run alone bit for bit
    (one token, a chain and a token tree over caches of different lengths)."""
    from tandem.engine.model import llama
    from tandem.engine.native import attend

    if attend.library() is None:
        pytest.skip("no AVX-512 or no C compiler here: torch's attention serves")
    target = quantize_model(tiny_loaded, "Q4_1", activations=activations)
    native = NativeLlama(target.model, quantized=target.quantized)
    described = []
    real = llama._FusedAttention._describe
    monkeypatch.setattr(llama._FusedAttention, "_describe", lambda self: described.append(len(self.many)) or real(self))
    gen = torch.Generator().manual_seed(2)
    ctx = [torch.randint(0, native.vocab, (n,), generator=gen).tolist() for n in (5, 300, 40)]
    blocks = [[7], [3, 9, 11, 2, 5], [4, 6, 8, 1]]
    trees = [None, None, [-1, 0, 0, 1]]

    def fresh():
        caches = [native.new_cache() for _ in ctx]
        for ids, cache in zip(ctx, caches):
            native.forward(ids, cache, all_logits=False)
        return caches

    together = native.forward_batch(list(zip(blocks, fresh())), trees=trees)
    assert described == [3], "the batch's attention went through one call for its three blocks"
    for i, (block, cache) in enumerate(zip(blocks, fresh())):
        alone = native.forward_batch([(block, cache)], trees=[trees[i]])
        assert torch.equal(together[i], alone[0]), i
    assert described == [3], "a lone block keeps the one-block call"
