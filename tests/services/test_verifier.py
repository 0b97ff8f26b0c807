"""The verifier over real gRPC: output equal to the single-process reference, prefix reuse across
turns, clear errors for bad input, KV budget eviction."""

from __future__ import annotations

import grpc
import pytest

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.engine.scheduler.generate import Engine
from tandem.services.verifier.core import VerifierCore
from tandem.services.verifier.server import build_server
from tandem.services.verifier.settings import VerifierSettings
from tandem.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc


@pytest.fixture()
def verifier(tiny_loaded):
    core = VerifierCore(VerifierSettings(verifier_id="v-test", port=0, kv_capacity_tokens=4096), tiny_loaded)
    server, port, _ = build_server(core)
    server.start()
    core.start(f"127.0.0.1:{port}")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield core, verifier_pb2_grpc.VerifierStub(channel)
    channel.close()
    server.stop(None)
    core.stop()


def _request(context, session="", max_new=24, strategy=common_pb2.DRAFT_STRATEGY_NGRAM, **sampling):
    return verifier_pb2.SessionGenerateRequest(
        session_id=session,
        context_ids=context,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, **sampling),
        speculation=common_pb2.SpeculationParams(strategy=strategy),
    )


def _collect(stream):
    tokens, last = [], None
    for msg in stream:
        if msg.token_ids:
            assert msg.first_index == len(tokens), "each committed token is emitted once, in order"
            tokens.extend(msg.token_ids)
        last = msg
    return tokens, last


def _reference(loaded, context, max_new, strategy=DraftStrategy.none):
    engine = Engine(loaded)
    return engine.generate(context, SamplingParams(max_new_tokens=max_new), SpecConfig(strategy=strategy)).token_ids


CONTEXT = [5, 17, 42, 99, 17, 42, 7, 250, 17, 42, 99, 3, 11]


def test_greedy_output_equals_reference(verifier, tiny_loaded):
    core, stub = verifier
    expected = _reference(tiny_loaded, CONTEXT, 24)
    for strategy in (common_pb2.DRAFT_STRATEGY_NONE, common_pb2.DRAFT_STRATEGY_NGRAM):
        tokens, last = _collect(stub.Generate(_request(CONTEXT, strategy=strategy)))
        assert tokens == expected
        assert last.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
        assert last.stats.steps >= 1
        assert last.stats.accepted + last.stats.steps >= len(tokens)


def test_second_turn_prefills_only_new_tokens(verifier):
    core, stub = verifier
    tokens, last = _collect(stub.Generate(_request(CONTEXT, session="s1")))
    assert last.stats.prefill_reused_tokens == 0
    assert last.stats.prefill_computed_tokens == len(CONTEXT) - 1
    turn2 = CONTEXT + tokens + [9, 8, 7, 6]
    _, last2 = _collect(stub.Generate(_request(turn2, session="s1")))
    # Everything up to the last committed token was resident; only the new turn is computed.
    assert last2.stats.prefill_reused_tokens >= len(CONTEXT) + len(tokens) - 1
    assert last2.stats.prefill_computed_tokens == len(turn2) - 1 - last2.stats.prefill_reused_tokens
    assert last2.stats.prefill_computed_tokens <= 5
    assert "s1" in core.session_ids()


def test_bad_input_is_invalid_argument_and_service_keeps_serving(verifier, tiny_loaded):
    core, stub = verifier
    cases = {
        "outside the vocabulary": _request([1, 2, 100000]),
        "is empty": _request([]),
        "does not fit": _request([7] * 600),
    }
    for needle, req in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            _collect(stub.Generate(req))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub.Generate(_request(CONTEXT, temperature=-1.0)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    tokens, _ = _collect(stub.Generate(_request(CONTEXT)))
    assert tokens == _reference(tiny_loaded, CONTEXT, 24)


def test_kv_budget_evicts_least_recently_used(tiny_loaded):
    core = VerifierCore(VerifierSettings(verifier_id="v-small", port=0, kv_capacity_tokens=80), tiny_loaded)
    sampling, spec = SamplingParams(max_new_tokens=8), SpecConfig(strategy=DraftStrategy.none)
    for sid in ("a", "b", "c"):
        list(core.generate(sid, CONTEXT * 2, sampling, spec))
    # Each session holds 26 + 8 tokens: two fit in 80, so the oldest was evicted.
    assert core.session_ids() == ["b", "c"]
    assert core.metrics.value("tandem_kv_evictions_total") == 1
    assert core.kv_used_tokens() <= 80
    assert core.metrics.value("tandem_prefill_recomputed_tokens_total") == 0
    # "a" comes back for its next turn: the 26 tokens it had held are computed again, and counted
    # so; a new session's prefill is not (below the 32 tokens worth sharing, nothing is copied).
    *_, last = core.generate("a", CONTEXT * 2 + [5, 6], sampling, spec)
    assert last.stats.prefill_reused_tokens == 0 and last.stats.prefill_computed_tokens == 27
    assert core.metrics.value("tandem_prefill_recomputed_tokens_total") == len(CONTEXT) * 2
    list(core.generate("d", CONTEXT * 2, sampling, spec))
    assert core.metrics.value("tandem_prefill_recomputed_tokens_total") == len(CONTEXT) * 2


def test_a_shared_tool_list_counts_once_against_the_budget(tiny_loaded):
    """Sessions of one tenant that begin with the same 300-token tool list read its first 256
    positions (one attention run) from the first session's storage: each counts only the rest
    against the budget, four fit where two would with copies, the output is the target's, and
    the prefix outlives the session it came from."""
    core = VerifierCore(VerifierSettings(verifier_id="v-shared", port=0, kv_capacity_tokens=600), tiny_loaded)
    sampling, spec = SamplingParams(max_new_tokens=8), SpecConfig(strategy=DraftStrategy.none)
    tools = [4 + (i * 7) % 50 for i in range(300)]
    contexts = {sid: tools + [5 + i, 17, 42, 99] * 5 for i, sid in enumerate("abcde")}
    for sid in "abcd":
        *_, last = core.generate(sid, contexts[sid], sampling, spec)
        assert last.token_ids == _reference(tiny_loaded, contexts[sid], 8), sid
        if sid != "a":
            assert last.stats.prefill_reused_tokens >= len(tools)
    held = len(contexts["a"]) + 8  # each session: its context and 8 tokens, the last one pending
    assert core.session_ids() == list("abcd")  # copies (4 x 328 tokens) would not fit in 600
    assert core.metrics.value("tandem_kv_evictions_total") == 0
    assert core.kv_used_tokens() == held + 3 * (held - 256)
    *_, last = core.generate("e", contexts["e"], sampling, spec)  # 600 - 544 is too little: "a" goes
    assert last.token_ids == _reference(tiny_loaded, contexts["e"], 8)
    assert core.session_ids() == list("bcde") and core.metrics.value("tandem_kv_evictions_total") == 1
    assert core.kv_used_tokens() == 256 + 4 * (held - 256)  # a's prefix, still read by four, once
    *_, last = core.generate("b", contexts["b"] + [7, 8], sampling, spec)  # a next turn over it
    assert last.token_ids == _reference(tiny_loaded, contexts["b"] + [7, 8], 8)


def test_a_next_turn_sent_on_the_last_message_finds_its_session_idle(tiny_loaded):
    """The client may send a session's next turn the moment it reads the last message of the
    previous one, before the verifier's handler is resumed to finish: the session is idle by then
    (once, under 64 sessions on 2 cores, such a turn failed with "already generating")."""
    core = VerifierCore(VerifierSettings(verifier_id="v-turns", port=0, kv_capacity_tokens=4096), tiny_loaded)
    sampling, spec = SamplingParams(max_new_tokens=6), SpecConfig(strategy=DraftStrategy.ngram)
    first = core.generate("s", CONTEXT, sampling, spec)
    result = next(item for item in first if hasattr(item, "token_ids"))  # the last message; `first` not resumed
    context = CONTEXT + result.token_ids + [5, 6]
    *_, second = core.generate("s", context, sampling, spec)
    assert second.token_ids == _reference(tiny_loaded, context, 6)
    assert second.stats.prefill_reused_tokens >= len(CONTEXT) + len(result.token_ids) - 1
    first.close()
    assert core.session_ids() == ["s"]


def test_kv_pool_slots_follow_the_budget_within_free_memory():
    from tandem.services.verifier.core import kv_pool_slots

    # room for every admitted session's caches as they double, and each one's first 256 slots
    assert kv_pool_slots(10_000, 8, free_bytes=10**12, bytes_per_slot=1000) == 2 * 10_000 + 8 * 256
    # memory-bound: at most 90% of what is free
    assert kv_pool_slots(10**9, 64, free_bytes=10**9, bytes_per_slot=1000) == 900_000
    assert kv_pool_slots(1, 1, free_bytes=10, bytes_per_slot=1000) == 1


def test_a_verifier_sizes_its_kv_pool_from_its_budget(tiny_loaded, monkeypatch):
    """Where caches live in a KV pool (a GPU; here the model is told it is on one), the verifier
    sizes the pool from its KV budget, not the model's default share of memory, before the first
    cache; generation through the pool is the target's."""
    from tandem.engine.model import llama

    want = _reference(tiny_loaded, CONTEXT, 8)  # caches of their own (a CPU's default)
    monkeypatch.setattr(llama, "default_kv_pool_slots", lambda device, per_slot: 123)
    core = VerifierCore(VerifierSettings(verifier_id="v-pool", port=0, kv_capacity_tokens=1000, max_sessions=4),
                        tiny_loaded)
    impl = core.engine.runner.backend.impl
    sampling, spec = SamplingParams(max_new_tokens=8), SpecConfig(strategy=DraftStrategy.ngram)
    tokens = [t for item in core.generate("a", CONTEXT, sampling, spec) if hasattr(item, "tokens")
              for t in item.tokens]
    assert impl.kv_pool is not None and impl.kv_pool.k.shape[2] == 2 * 1000 + 4 * 256
    assert tokens == want
    with pytest.raises(RuntimeError, match="size it before any cache"):
        impl.size_kv_pool(10)


def test_get_info(verifier, tiny_loaded):
    core, stub = verifier
    info = stub.GetInfo(verifier_pb2.InfoRequest())
    assert info.verifier_id == "v-test"
    assert info.vocab_size == tiny_loaded.vocab_size
    assert list(info.eos_token_ids) == tiny_loaded.eos_token_ids
