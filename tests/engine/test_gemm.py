"""The GEMM tuner (tandem.engine.model.gemm): what it chooses, that it is cached, and that whatever it
chooses keeps speculation lossless.

The lossless rule under test: a weight's path depends on its shape and the call's row count only, so
plain decoding and verification compute with the same arithmetic at every row count. Each path the
tuner can pick is forced in turn and long greedy generations are compared with plain decoding.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from smollm_fixture import smollm  # noqa: F401 - fixture
from tandem.contract.params import SamplingParams, SpecConfig
from tandem.engine.model import gemm
from tandem.engine.model.gemm import GemmPath, GemmSettings, SLOTS, TunedLinear, candidates, forced_plan, slot_of
from tandem.engine.model.llama import NativeLlama
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.scheduler.generate import Engine

PATHS = [p.value for p in candidates()]


@pytest.fixture(autouse=True)
def _restore_settings():
    yield
    GemmSettings.configure(gemm.INVARIANT, cache=None)  # the default
    gemm._memo.clear()


def test_every_path_computes_the_same_product() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=gen)  # [out, in]
    for path in candidates():
        lin = TunedLinear(w, forced_plan(path, [(40, 24)]))
        for rows in (*range(1, 18), 64):
            x = torch.randn(rows, 24, generator=gen)
            assert torch.allclose(lin(x), F.linear(x, w), atol=1e-5), (path, rows)


def test_row_slots_cover_decode_blocks_and_prefill() -> None:
    assert [slot_of(n) for n in range(1, 18)] == list(range(17))
    assert slot_of(18) == slot_of(500) == len(SLOTS) - 1


def test_prune_keeps_few_layouts_and_never_a_slow_one() -> None:
    a, b, c = GemmPath.mkl_nt, GemmPath.onednn_b4, GemmPath.mkl_nn
    n = len(SLOTS)
    times = {
        a: [1.0] * n,
        b: [1.04] * (n - 1) + [0.5],  # within 10% everywhere, far ahead on the last slot
        c: [0.99] + [3.0] * (n - 1),  # 1% ahead on one slot only
    }
    chosen = [gemm.parse_choice(entry, rows)[0] for entry, rows in zip(gemm._prune(times), SLOTS)]
    # b is needed for the last slot and is within 10% everywhere else: one layout serves all
    assert set(chosen) == {b} or set(chosen) == {a, b}
    best = [min(t[i] for t in times.values()) for i in range(n)]
    assert all(times[p][i] <= best[i] * gemm.KEEP_WITHIN for i, p in enumerate(chosen))
    assert c not in chosen


def test_a_few_rows_are_padded_where_a_larger_call_is_faster() -> None:
    """oneDNN on the EPYC host: 1-2 rows cost more than 3-5 (measured), so 1-2 row calls pad; a
    gain under 15% (3 rows: 233 -> 221) is not worth it."""
    p = GemmPath.onednn_b4
    times = {p: [290.0, 273.0, 233.0, 224.0, 221.0] + [300.0 + i for i in range(len(SLOTS) - 5)]}
    chosen = gemm._prune(times)
    assert chosen[:5] == ["onednn_b4@5"] * 2 + ["onednn_b4"] * 3
    assert chosen[-1] == "onednn_b4"  # prefill never pads
    assert gemm.parse_choice(chosen[0], 1) == (p, 5) and gemm.parse_choice(chosen[-1], 300) == (p, 300)


def test_a_padded_plan_computes_the_same_product() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=gen)
    plan = forced_plan(GemmPath.mkl_nn, [(40, 24)])
    plan.choice["40x24"][:3] = ["mkl_nn@4"] * 3
    lin = TunedLinear(w, plan)
    for rows in (1, 2, 3, 4, 64):
        x = torch.randn(rows, 24, generator=gen)
        y = lin(x)
        assert y.shape == (rows, 40) and torch.allclose(y, F.linear(x, w), atol=1e-5)


def test_a_plan_is_measured_once_and_then_read_from_the_cache(tmp_path, monkeypatch) -> None:
    GemmSettings.configure("auto", cache=tmp_path, progress=False)
    shapes = [(48, 32), (32, 32)]
    plan = gemm.plan_for(shapes)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and plan.mode == "auto"
    record = json.loads(files[0].read_text())
    assert record["cpu"] == gemm.cpu_model() and record["threads"] == torch.get_num_threads()
    assert set(record["choice"]) == {"48x32", "32x32"} and all(len(v) == len(SLOTS) for v in record["choice"].values())
    # a new process (no memo) reads the file instead of measuring
    gemm._memo.clear()

    def no_tuning(*args, **kwargs):
        raise AssertionError("measured again although a cached plan exists")

    monkeypatch.setattr(gemm, "tune", no_tuning)
    assert gemm.plan_for(shapes).choice == plan.choice
    # a damaged file is measured again (and replaced), with a warning, not a crash
    gemm._memo.clear()
    files[0].write_text("{not json")
    monkeypatch.undo()
    again = gemm.plan_for(shapes)
    assert again.mode == "auto" and json.loads(files[0].read_text())["choice"] == again.choice


def test_the_key_separates_machines_and_thread_counts(monkeypatch) -> None:
    shapes = [(48, 32)]
    key = gemm.plan_key(shapes)
    monkeypatch.setattr(gemm, "cpu_model", lambda: "Some Other CPU")
    assert gemm.plan_key(shapes) != key
    monkeypatch.undo()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert gemm.plan_key(shapes) != key
    finally:
        torch.set_num_threads(threads)


def test_an_unknown_mode_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="auto or one of mkl_nt"):
        GemmSettings.configure("fastest")


def test_a_model_holds_only_the_layouts_its_plan_uses(tiny_loaded) -> None:
    GemmSettings.configure("mkl_nn")
    nat = NativeLlama(tiny_loaded.model)
    assert nat.gemm_plan.mode == "mkl_nn"
    layer = nat.layers[0]["wgu"]
    assert set(layer.layouts) == {GemmPath.mkl_nn}


def _long_greedy_equal(target, ctx, tokens, spec) -> tuple[list[int], object]:
    engine = Engine(target)
    plain = engine.generate(ctx, SamplingParams(max_new_tokens=tokens, ignore_eos=True), SpecConfig(strategy="none"))
    fast = engine.generate(ctx, SamplingParams(max_new_tokens=tokens, ignore_eos=True), spec)
    assert fast.token_ids == plain.token_ids
    return plain.token_ids, fast.stats


@pytest.mark.parametrize("path", PATHS)
def test_greedy_speculation_equals_plain_decoding_with_every_path(path, tiny_loaded, contexts) -> None:
    GemmSettings.configure(path)
    spec = SpecConfig(strategy="ngram", adaptive=False, max_draft_tokens=16)  # blocks of 1-17 rows
    accepted = 0
    for name in ("code", "json", "chat"):
        _, stats = _long_greedy_equal(tiny_loaded, contexts[name], 300, spec)
        accepted += stats.accepted
    assert accepted > 0  # blocks were really verified, or this compares plain with plain


@pytest.fixture(scope="module")
def contexts(tiny_tokenizer):
    from test_engine import _contexts

    return _contexts(tiny_tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["auto", *PATHS])
def test_smollm_greedy_speculation_equals_plain_decoding_with_every_path(path, smollm) -> None:  # noqa: F811
    """The embedded model, whose logits have real near-ties: a path that computed verification
    differently from plain decoding would show here first."""
    GemmSettings.configure(path, progress=False)
    ctx = apply_chat_template(smollm.tokenizer, [{
        "role": "user", "content": "Write a Python class for a bank account with deposit, withdraw and balance "
                                   "methods, then the same class again with type hints."}])
    spec = SpecConfig(strategy="ngram", adaptive=False, max_draft_tokens=8)
    _, stats = _long_greedy_equal(smollm, ctx, 96, spec)
    assert stats.accepted > 0


def test_timing_rotates_through_enough_weights_to_leave_the_cache(monkeypatch) -> None:
    """A path is timed on weights that come from where the model's forward finds them: a model
    larger than the last-level cache is timed over more than that cache (so from DRAM), a small one
    over its own size (it stays cached in the forward too)."""
    llc = gemm.last_level_cache_bytes()
    assert llc >= 0
    big = 10 * max(llc, gemm.MIN_COLD_BYTES)
    assert gemm.cold_bytes(big) >= max(2 * llc, gemm.MIN_COLD_BYTES)
    assert gemm.cold_bytes(1 << 20) == 1 << 20
    monkeypatch.setattr(gemm, "last_level_cache_bytes", lambda: 512 << 20)  # the Intel host's L3
    assert gemm.cold_bytes(538 << 20) == 538 << 20 and gemm.cold_bytes(8 << 30) == 1 << 30
    # tune() rotates through the asked bytes of copies of each shape
    seen = {}

    def record(path, weights, rows, in_features, reps):
        seen[(in_features, path)] = len(weights)
        return 1e-6 * rows

    monkeypatch.setattr(gemm, "_time_path", record)
    gemm.tune([(64, 32)], rotate_bytes=64 * 32 * 4 * 10)
    assert seen and all(n == 10 for (_, path), n in seen.items() if path in (GemmPath.mkl_nt, GemmPath.mkl_nn))
    # the plan of a model is keyed by the bytes it rotates through (a plan measured hot is not reused)
    assert gemm.plan_key([(64, 32)], 1 << 20) != gemm.plan_key([(64, 32)], 600 << 20)


# --- the batch-invariant decode path ---------------------------------------------------------------


def _invariant_kernels() -> bool:
    from tandem.engine.native import attend, gemv, rowops

    return gemv.library() is not None and attend.library() is not None and rowops.library() is not None


needs_invariant = pytest.mark.skipif(not _invariant_kernels(), reason="needs our GEMV, attention (AVX-512) and row kernels")


ROW_INVARIANT = [p.value for p in (GemmPath.tandem_gemv, GemmPath.tandem_panel) if p in candidates()]


@needs_invariant
@pytest.mark.parametrize("kernel", ROW_INVARIANT)
def test_on_our_kernels_a_block_computes_each_row_as_plain_decoding_does(kernel, tiny_loaded) -> None:
    """With every GEMM on one of our row-invariant kernels (the streaming one or the panel one), a
    verification block's logits are the logits of the same tokens fed one at a time, bit for bit,
    and the KV it writes is the same: the forward is batch-invariant. The measured plan may mix
    paths by row count and then is not (it is lossless by the shared-path rule instead)."""
    from tandem.engine.model.llama import NativeLlama

    GemmSettings.configure(kernel)
    native = NativeLlama(tiny_loaded.model)
    assert native.batch_invariant
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, native.vocab, (400,), generator=gen).tolist()
    for ctx, n in ((5, 9), (250, 17), (300, 32), (380, 2)):
        block_cache, step_cache = native.new_cache(420), native.new_cache(420)
        native.forward(ids[:ctx], block_cache, all_logits=False)
        native.forward(ids[:ctx], step_cache, all_logits=False)
        block = native.forward(ids[ctx : ctx + n], block_cache)  # [n, vocab]
        steps = torch.cat([native.forward([t], step_cache) for t in ids[ctx : ctx + n]])  # [n, vocab]
        assert torch.equal(block, steps), (ctx, n)
        assert torch.equal(block_cache.k[:, :, : ctx + n], step_cache.k[:, :, : ctx + n])
        assert torch.equal(block_cache.v[:, :, : ctx + n], step_cache.v[:, :, : ctx + n])
    # Several sessions' blocks in one batched forward: still each row's own bits.
    a, b = native.new_cache(420), native.new_cache(420)
    native.forward(ids[:40], a, all_logits=False)
    native.forward(ids[:100], b, all_logits=False)
    la, lb = native.forward_batch([(ids[40:45], a), (ids[100:103], b)])
    a2, b2 = native.new_cache(420), native.new_cache(420)
    native.forward(ids[:40], a2, all_logits=False)
    native.forward(ids[:100], b2, all_logits=False)
    assert torch.equal(la, torch.cat([native.forward([t], a2) for t in ids[40:45]]))
    assert torch.equal(lb, torch.cat([native.forward([t], b2) for t in ids[100:103]]))
    GemmSettings.configure("mkl_nn")
    assert not NativeLlama(tiny_loaded.model).batch_invariant


@needs_invariant
@pytest.mark.skipif(len(ROW_INVARIANT) < 2, reason="needs both row-invariant kernels")
def test_a_plan_mixing_our_two_kernels_is_not_called_batch_invariant(tiny_loaded) -> None:
    """Each kernel is row-invariant, but they sum in different orders: a block on the panel kernel
    and a one-token step on the streaming kernel give different bits."""
    from tandem.engine.model.llama import NativeLlama

    shapes = sorted({tuple(lin.shape) for lin in _tuned_linears(tiny_loaded)})
    plan = forced_plan(GemmPath.tandem_panel, shapes)
    for key in plan.choice:
        plan.choice[key][0] = GemmPath.tandem_gemv.value  # one-row calls on the other kernel
    assert not NativeLlama(tiny_loaded.model, plan=plan).batch_invariant
    assert NativeLlama(tiny_loaded.model, plan=forced_plan(GemmPath.tandem_panel, shapes)).batch_invariant


def _tuned_linears(loaded):
    from tandem.engine.model.llama import NativeLlama

    native = NativeLlama(loaded.model)
    return [w[k] for w in native.layers for k in native._LINEAR] + native.head_chunks


@needs_invariant
@pytest.mark.parametrize("strategy", ["ngram", "model"])
def test_on_our_kernels_logprobs_equal_plain_decodings_bit_for_bit(strategy, tiny_loaded, contexts) -> None:
    """The logprobs of tokens committed by verification blocks are plain decoding's to the last bit
    (the measured plan gives them within ~1e-6: tests/engine/test_sampling_controls.py)."""
    from tandem.contract.params import SamplingParams
    from tandem.engine.scheduler.generate import Engine

    GemmSettings.configure("tandem_gemv")
    draft = None
    if strategy == "model":
        import copy

        from tandem.engine.model.loading import LoadedModel

        model = copy.deepcopy(tiny_loaded.model)
        with torch.no_grad():
            for name, w in model.named_parameters():
                if "norm" not in name:
                    w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) * w.std() * 0.1)
        draft = LoadedModel(model_id="near", path="", model=model, tokenizer=tiny_loaded.tokenizer)
    engine = Engine(tiny_loaded, draft)
    sampling = SamplingParams(max_new_tokens=48, ignore_eos=True, top_logprobs=4)
    accepted = 0
    for name in ("code", "json", "chat"):
        runs = []
        for spec in (SpecConfig(strategy="none"), SpecConfig(strategy=strategy, adaptive=False, max_draft_tokens=6)):
            gen = engine.start(contexts[name], sampling, spec)
            runs.append([lp for step in gen for lp in step.logprobs])
            accepted += gen.result().stats.accepted
        plain, fast = runs
        assert [t.token for t in fast] == [t.token for t in plain]
        assert [t.logprob for t in fast] == [t.logprob for t in plain], name  # exact floats
        assert [t.top for t in fast] == [t.top for t in plain], name
    assert accepted > 0  # blocks were verified, or this compares plain with plain


@needs_invariant
@pytest.mark.parametrize("path", ["mkl_nn", "auto"])
def test_logprobs_requests_equal_plain_decodings_bit_for_bit_on_any_plan(path, tiny_loaded, contexts) -> None:
    """A request that asks for logprobs has its blocks computed with each row's one-token bits
    (gemm.rows_alone), whatever plan serves the others: its logprobs with speculation equal plain
    decoding's exactly, batched with other sessions or not. Without logprobs the same plan's block
    rows differ from one-token steps in the last bits (the witness that rows_alone is what makes
    them equal)."""
    from tandem.contract.params import SamplingParams

    GemmSettings.configure(path, cache=None, progress=False)
    native = NativeLlama(tiny_loaded.model)
    assert native.can_run_rows_alone
    engine = Engine(tiny_loaded, None)
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True, top_logprobs=3)
    accepted = 0
    for name in ("code", "json"):
        runs = []
        for spec in (SpecConfig(strategy="none"), SpecConfig(strategy="ngram", adaptive=False, max_draft_tokens=6)):
            gen = engine.start(contexts[name], sampling, spec)
            runs.append([lp for step in gen for lp in step.logprobs])
            accepted += gen.result().stats.accepted
        plain, fast = runs
        assert [(t.token, t.logprob, t.top) for t in fast] == [(t.token, t.logprob, t.top) for t in plain], name
    assert accepted > 0
    if path == "mkl_nn":  # the witness: this plan's 9-row block is not its one-token steps' bits
        ids = (contexts["code"] * 20)[:60]

        def block_and_steps():
            block_cache, step_cache = native.new_cache(100), native.new_cache(100)
            native.forward(ids[:50], block_cache, all_logits=False)
            native.forward(ids[:50], step_cache, all_logits=False)
            block = native.forward(ids[50:59], block_cache)  # [9, vocab]
            return block, torch.cat([native.forward([t], step_cache) for t in ids[50:59]])  # [9, vocab]

        block, steps = block_and_steps()
        assert not torch.equal(block, steps)
        with gemm.rows_alone():
            block, steps = block_and_steps()
        assert torch.equal(block, steps)
