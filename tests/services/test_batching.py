"""Verifier throughput: one batched forward for all ready sessions, KV budget, shared prefixes.

Everything runs on the tiny random Llama with the native backend; outputs are compared with the
single-process reference, which runs one sequence at a time.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import redis
import torch

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.contract.results import GenerationResult
from tandem.engine.model.llama import NativeLlama
from tandem.engine.scheduler.generate import Engine
from tandem.services.verifier.core import Overloaded, VerifierCore
from tandem.services.verifier.drafter_client import GrpcDrafterConnector
from tandem.services.verifier.settings import VerifierSettings
from tandem.serving.residency import ResidencyPublisher


def _contexts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(10, 500, (6 + 7 * i,), generator=g).tolist()
        out.append(base + base[:5] + base)  # repetition: prompt lookup finds matches
    return out


def test_batched_forward_equals_per_session_forwards(tiny_loaded):
    nat = NativeLlama(tiny_loaded.model)
    ctxs = _contexts(4)
    blocks = [[3], [7, 8, 9, 10, 11], [12, 13], [14, 15, 16]]
    single, caches_single = [], []
    for ctx, block in zip(ctxs, blocks):
        cache = nat.new_cache(4)  # small: forces the cache to grow inside the batch
        nat.forward(ctx, cache, all_logits=False)
        single.append(nat.forward(block, cache))
        caches_single.append(cache)
    caches = []
    for ctx in ctxs:
        cache = nat.new_cache(4)
        nat.forward(ctx, cache, all_logits=False)
        caches.append(cache)
    batched = nat.forward_batch(list(zip(blocks, caches)), [True, True, False, True])
    assert batched[2] is None, "a block that needs no logits (prefill) gets none"
    for i in (0, 1, 3):
        assert batched[i].shape == single[i].shape
        torch.testing.assert_close(batched[i], single[i], rtol=1e-4, atol=1e-4)
        assert torch.equal(batched[i].argmax(-1), single[i].argmax(-1))
    for a, b in zip(caches, caches_single):
        assert a.length == b.length
        torch.testing.assert_close(a.k[:, :, : a.length], b.k[:, :, : b.length], rtol=1e-4, atol=1e-4)
    # Independent rollback: each cache goes back on its own, the others are untouched.
    caches[1].crop_to(caches[1].length - 3)
    assert [c.length for c in caches] == [b.length for b in caches_single][:1] + [caches_single[1].length - 3] + [
        c.length for c in caches_single[2:]]


def test_int8_draft_forward_stays_close_to_float32(tiny_loaded):
    """Drafts run with int8 weights on a CPU (memory-bound steps); the numbers move by rounding
    only, and the target's own forward is never quantised."""
    from tandem.engine.speculation.proposers import _DraftLM

    exact, quant = NativeLlama(tiny_loaded.model), NativeLlama(tiny_loaded.model, int8=True)
    if not quant.int8:
        pytest.skip("no int8 kernel here, ours or torch's (drafts then run in float32)")
    from tandem.engine.model.llama import _Int8Weight
    from tandem.engine.native import panel

    kernels = {w.kernel for layer in quant.layers for w in (layer[k] for k in NativeLlama._LINEAR)}
    from tandem.engine.native import quant as quant_kernels

    assert kernels <= {"panel", "blocks", "torch"}
    if panel.library() is None and not quant_kernels.int8_activations_available():
        assert kernels == {"torch"}
    assert set(_Int8Weight.CHOSEN.values()) >= kernels  # chosen by measurement, once per shape
    ctx = _contexts(1)[0]
    a = exact.forward(ctx, exact.new_cache())  # [n, vocab]
    b = quant.forward(ctx, quant.new_cache())
    assert a.shape == b.shape and b.dtype == torch.float32
    assert (a - b).abs().max() < 0.1 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8
    assert _DraftLM(tiny_loaded).native.int8, "the draft proposer uses the int8 forward"
    assert not _DraftLM(tiny_loaded, int8=False).native.int8
    from tandem.engine.scheduler.runner import TargetRunner

    target_impl = getattr(TargetRunner(tiny_loaded).backend, "impl", None)
    assert target_impl is not None and not target_impl.int8


def _verifier(loaded, **kw) -> VerifierCore:
    return VerifierCore(VerifierSettings(**{"verifier_id": "v-batch", "port": 0, **kw}), loaded,
                        connector=GrpcDrafterConnector())


def test_concurrent_sessions_share_forwards_and_match_the_reference(tiny_loaded, kv_pool):
    core = _verifier(tiny_loaded)
    ctxs = _contexts(5, seed=1)
    lengths = [40, 25, 33, 12, 28]  # sessions leave at different steps
    spec = SpecConfig(strategy=DraftStrategy.ngram, adaptive=False, max_draft_tokens=3)
    expected = [
        Engine(tiny_loaded).generate(c, SamplingParams(max_new_tokens=n), SpecConfig(strategy=DraftStrategy.none)).token_ids
        for c, n in zip(ctxs, lengths)
    ]
    results: dict[int, GenerationResult] = {}
    start = threading.Barrier(3)

    def run(i: int) -> None:
        if i < 3:
            start.wait()  # three start together; two join while they run
        items = list(core.generate(f"s{i}", ctxs[i], SamplingParams(max_new_tokens=lengths[i]), spec))
        results[i] = items[-1]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    for t in threads[:3]:
        t.start()
    for t in threads[3:]:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(5):
        assert results[i].token_ids == expected[i], f"session {i}"
    ex = core.executor
    total_steps = sum(r.stats.steps for r in results.values()) + 5  # + prefills
    assert ex.batches < total_steps, "some forwards carried several sessions"
    assert sum(r.stats.accepted for r in results.values()) > 0, "drafts were verified inside batches"
    if kv_pool[0]:
        assert len(kv_pool) > 1, "batched steps went through the pooled attention"


def test_admission_control_when_every_slot_is_busy(tiny_loaded):
    core = _verifier(tiny_loaded, kv_capacity_tokens=60, admission_queue=0)  # no waiting: refused at once
    ctx = _contexts(3)[2][:30]
    assert len(ctx) == 30
    running = core.generate("a", ctx, SamplingParams(max_new_tokens=20), SpecConfig(strategy=DraftStrategy.none))
    next(running)  # session a is mid-generation: busy, not evictable
    with pytest.raises(Overloaded) as err:
        list(core.generate("b", ctx[::-1], SamplingParams(max_new_tokens=4), SpecConfig(strategy=DraftStrategy.none)))
    assert "full" in str(err.value) and err.value.retry_after_s > 0
    list(running)
    # Once a is idle, b gets in by evicting it.
    items = list(core.generate("b", ctx[::-1], SamplingParams(max_new_tokens=4), SpecConfig(strategy=DraftStrategy.none)))
    assert isinstance(items[-1], GenerationResult)
    assert core.session_ids() == ["b"] and core.metrics.value("tandem_kv_evictions_total") == 1


def test_overload_is_resource_exhausted_with_retry_hint(tiny_loaded):
    from tandem.services.verifier.server import build_server
    from tandem.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

    core = _verifier(tiny_loaded, kv_capacity_tokens=10)
    server, port, _ = build_server(core)
    server.start()
    try:
        stub = verifier_pb2_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        req = verifier_pb2.SessionGenerateRequest(session_id="big", context_ids=list(range(10, 40)),
                                                  sampling=common_pb2.SamplingParams(max_new_tokens=2))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.value.trailing_metadata()).get("retry-after-ms")
    finally:
        server.stop(None)


def test_eviction_is_reflected_in_redis_at_once(tiny_loaded, redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    publisher = ResidencyPublisher(redis_url, heartbeat_ttl_s=5, session_ttl_s=60)
    core = VerifierCore(VerifierSettings(verifier_id="v-evict", port=0, kv_capacity_tokens=50), tiny_loaded,
                        publisher=publisher)
    ctxs = [c[:30] for c in _contexts(4, seed=3)[2:]]
    none = SpecConfig(strategy=DraftStrategy.none)
    list(core.generate("first", ctxs[0], SamplingParams(max_new_tokens=4), none))
    assert client.exists("tandem:v1:session:first")
    assert client.ttl("tandem:v1:session:first") > 0
    list(core.generate("second", ctxs[1], SamplingParams(max_new_tokens=4), none))
    assert core.session_ids() == ["second"]
    assert not client.exists("tandem:v1:session:first"), "the evicted session's key is gone"
    assert client.exists("tandem:v1:session:second")


def test_shared_prefix_is_copied_not_recomputed(tiny_loaded, kv_pool):
    core = _verifier(tiny_loaded)
    system = _contexts(1, seed=5)[0] * 2  # a long common prefix (system prompt, tool schema)
    a, b = system + [11, 12, 13], system + [21, 22, 23, 24]
    none = SpecConfig(strategy=DraftStrategy.none)
    ra = list(core.generate("a", a, SamplingParams(max_new_tokens=6), none))[-1]
    assert ra.stats.prefill_computed_tokens == len(a) - 1
    rb = list(core.generate("b", b, SamplingParams(max_new_tokens=6), none))[-1]
    assert core.metrics.value("tandem_prefix_shared_tokens_total") >= len(system) - 1
    assert rb.stats.prefill_computed_tokens <= len(b) - len(system)
    reference = Engine(tiny_loaded).generate(b, SamplingParams(max_new_tokens=6), none).token_ids
    assert rb.token_ids == reference


def test_a_resident_session_takes_a_longer_shared_prefix_into_its_own_cache(tiny_loaded, kv_pool):
    """A session already resident (its cache allocated by its own earlier forwards) whose next turn
    shares a longer prefix with another session's than with its own history: the prefix is copied
    into its existing cache (found by the chaos soak: the copy ran outside inference mode and
    failed on a cache of inference tensors), and the output is the target alone's."""
    core = _verifier(tiny_loaded)
    system = _contexts(1, seed=5)[0] * 2
    none = SpecConfig(strategy=DraftStrategy.none)
    list(core.generate("a", system + [11, 12, 13], SamplingParams(max_new_tokens=6), none))
    # b is resident, and its first turn grew its cache past the initial 256 positions inside a
    # forward (in inference mode), as any long conversation's does.
    first = [(7 * i) % 97 + 3 for i in range(300)]
    list(core.generate("b", first, SamplingParams(max_new_tokens=6), none))
    second = system + [21, 22, 23, 24]
    rb = list(core.generate("b", second, SamplingParams(max_new_tokens=6), none))[-1]
    assert core.metrics.value("tandem_prefix_shared_tokens_total") >= len(system) - 1
    assert rb.token_ids == Engine(tiny_loaded).generate(second, SamplingParams(max_new_tokens=6), none).token_ids
