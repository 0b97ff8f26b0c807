"""Verifier and drafter over real gRPC sockets: output equals the single-process reference for
every strategy, and drafter faults (death, return, garbage) change speed, never text."""

from __future__ import annotations

import time

import grpc
import pytest

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.contract.results import GenerationResult
from tandem.engine.scheduler.generate import Engine
from tandem.engine.speculation.suffix import scope_of
from tandem.services.drafter.core import DrafterCore
from tandem.services.drafter.server import build_server as build_drafter
from tandem.services.drafter.settings import DrafterSettings
from tandem.services.verifier.core import VerifierCore
from tandem.services.verifier.drafter_client import GrpcDrafterConnector
from tandem.services.verifier.settings import VerifierSettings
from tandem.v1 import drafter_pb2, drafter_pb2_grpc

CONTEXT = [5, 17, 42, 99, 17, 42, 7, 250, 17, 42, 99, 3, 11, 5, 17, 42]


def _drafter(draft_loaded=None, port: int = 0, *, int8: bool = True):
    core = DrafterCore(DrafterSettings(drafter_id="d-test", draft_model=draft_loaded, draft_int8=int8))
    server, bound = build_drafter(core, f"127.0.0.1:{port}")
    server.start()
    return core, server, f"127.0.0.1:{bound}"


def _verifier(loaded, **overrides) -> VerifierCore:
    settings = VerifierSettings(**{"verifier_id": "v-test", "port": 0, "draft_wait_ms": 200, **overrides})
    return VerifierCore(settings, loaded, connector=GrpcDrafterConnector())


def _run(core, drafter_address, strategy, max_new=32, session="s", sampling=None):
    sampling = sampling or SamplingParams(max_new_tokens=max_new)
    # Fixed block lengths: these tests are about the wire and its faults, so drafts must be verified
    # whatever the adaptive controller would think of a random model's acceptance.
    spec = SpecConfig(strategy=strategy, adaptive=False, max_draft_tokens=4)
    items = list(core.generate(session, CONTEXT, sampling, spec, drafter_address))
    result = items[-1]
    assert isinstance(result, GenerationResult)
    emitted = [t for step in items[:-1] for t in step.tokens]
    assert emitted == result.token_ids, "every committed token is streamed exactly once, in order"
    return result


def _reference(loaded, max_new=32):
    return Engine(loaded).generate(
        CONTEXT, SamplingParams(max_new_tokens=max_new), SpecConfig(strategy=DraftStrategy.none)
    ).token_ids


@pytest.mark.parametrize("strategy", [DraftStrategy.ngram, DraftStrategy.suffix, DraftStrategy.model,
                                      DraftStrategy.hybrid])
def test_remote_drafting_is_lossless(tiny_loaded, tiny_draft_loaded, strategy):
    # The target itself as the draft model makes every draft right: all of them must be accepted.
    # (float32 draft steps: int8 rounding would make the target an imperfect draft of itself)
    draft = tiny_loaded if strategy in (DraftStrategy.model, DraftStrategy.hybrid) else None
    dcore, server, address = _drafter(draft, int8=False)
    try:
        core = _verifier(tiny_loaded, drafters=(address,))
        result = _run(core, address, strategy)
        assert result.token_ids == _reference(tiny_loaded)
        assert result.stats.drafted > 0 and result.stats.accepted > 0, "speculation must actually happen"
        if strategy == DraftStrategy.model:
            assert result.stats.accepted == result.stats.drafted
            # every block was right: the ones the steps used up are spent, not counted as rejected
            assert result.stats.rejected_blocks == 0
        if strategy == DraftStrategy.hybrid:  # the blocks say which proposer drafted them
            assert set(result.stats.by_proposer) <= {"ngram", "suffix", "model"} and result.stats.by_proposer
            assert result.stats.by_proposer.get("model", {}).get("accepted", 0) == \
                result.stats.by_proposer.get("model", {}).get("drafted", 0)
        assert result.stats.rejected_blocks >= 0
    finally:
        server.stop(None)
    assert dcore.info().active_sessions == 0, "the verifier closes its draft session"


def test_sampled_remote_drafts_are_verified(tiny_loaded, tiny_draft_loaded):
    # Sampled drafts arrive with their proposal distributions and go through rejection sampling;
    # their statistics are checked in tests/test_engine.py, here the wire path.
    dcore, server, address = _drafter(tiny_draft_loaded)
    try:
        core = _verifier(tiny_loaded, drafters=(address,))
        sampling = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
        result = _run(core, address, DraftStrategy.model, sampling=sampling, session="a")
        assert len(result.token_ids) == 16
        assert result.stats.drafted > 0 and result.stats.fallback_steps == 0
    finally:
        server.stop(None)


def test_drafter_killed_mid_generation_then_back(tiny_loaded):
    dcore, server, address = _drafter()
    port = int(address.rsplit(":", 1)[1])
    core = _verifier(tiny_loaded, drafters=(address,))
    core.settings.drafter_retry_s = 0.05
    sampling = SamplingParams(max_new_tokens=60)
    # suffix decoding: the drafter's (prompt lookup runs on the verifier and never needs it)
    steps = core.generate("s", CONTEXT, sampling, SpecConfig(strategy=DraftStrategy.suffix, adaptive=False), address)
    tokens, drafted_after_return = [], 0
    restarted = None
    for i, item in enumerate(steps):
        if isinstance(item, GenerationResult):
            result = item
            break
        tokens.extend(item.tokens)
        if i == 3:
            server.stop(None)  # the drafter dies mid-generation
        if i == 12:
            _, restarted, _ = _drafter(port=port)  # ... and comes back on the same address
            time.sleep(0.2)
        if restarted is not None and i > 14:
            drafted_after_return += item.drafted
    try:
        assert tokens == result.token_ids == _reference(tiny_loaded, 60)
        assert result.stats.fallback_steps > 0, "steps without a drafter are counted"
        assert drafted_after_return > 0, "speculation resumes when the drafter returns"
    finally:
        if restarted is not None:
            restarted.stop(None)


class GarbageDrafter(drafter_pb2_grpc.DrafterServicer):
    """A drafter that sends everything a broken or hostile drafter could, then one good block."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def Draft(self, request_iterator, context):
        for req in request_iterator:
            kind = req.WhichOneof("kind")
            if kind == "close":
                return
            n = len(req.open.context_ids) if kind == "open" else req.commit.committed_len
            sid = req.session_id
            yield drafter_pb2.DraftBlock(session_id=sid, base_len=n, token_ids=[self.vocab + 5, 1])  # out of vocabulary
            yield drafter_pb2.DraftBlock(session_id=sid, base_len=n, token_ids=[-3])  # negative id
            yield drafter_pb2.DraftBlock(session_id=sid, base_len=n + 7, token_ids=[1, 2])  # based in the future
            yield drafter_pb2.DraftBlock(session_id=sid, base_len=max(0, n - 2), token_ids=[0, 0, 1])  # stale overlap
            yield drafter_pb2.DraftBlock(  # malformed distribution: does not sum to 1
                session_id=sid, base_len=n, token_ids=[4],
                proposals=[drafter_pb2.SparseDistribution(token_ids=[4], probs=[3.0])])
            yield drafter_pb2.DraftBlock(  # support does not contain the drafted token
                session_id=sid, base_len=n, token_ids=[4],
                proposals=[drafter_pb2.SparseDistribution(token_ids=[5], probs=[1.0])])
            yield drafter_pb2.DraftBlock(session_id=sid, base_len=n, token_ids=[])  # empty
            yield drafter_pb2.DraftBlock(session_id="someone-else", base_len=n, token_ids=[1])  # other session
            # token trees: a parent that is not an earlier node, repeated siblings, a parent count
            # that does not match, a tree in a speculative block, a tree with proposal distributions
            yield drafter_pb2.DraftBlock(session_id=sid, base_len=n, token_ids=[1, 2], parents=[1, -1])
            yield drafter_pb2.DraftBlock(session_id=sid, base_len=n, token_ids=[3, 3], parents=[-1, -1])
            yield drafter_pb2.DraftBlock(session_id=sid, base_len=n, token_ids=[1, 2, 3], parents=[-1, 0])
            yield drafter_pb2.DraftBlock(session_id=sid, base_len=n, token_ids=[1, 2], parents=[-1, -1],
                                         speculative=True)
            yield drafter_pb2.DraftBlock(
                session_id=sid, base_len=n, token_ids=[4], parents=[-1],
                proposals=[drafter_pb2.SparseDistribution(token_ids=[4], probs=[1.0])])
            yield drafter_pb2.DraftBlock(session_id=sid, base_len=n, token_ids=[7, 7, 7, 7], proposer="ngram")  # wrong but valid


def test_garbage_drafter_changes_nothing(tiny_loaded):
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    drafter_pb2_grpc.add_DrafterServicer_to_server(GarbageDrafter(tiny_loaded.vocab_size), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        core = _verifier(tiny_loaded, drafters=(f"127.0.0.1:{port}",))
        for sampling in (SamplingParams(max_new_tokens=24),):
            result = _run(core, f"127.0.0.1:{port}", DraftStrategy.suffix, max_new=24, sampling=sampling)
            assert result.token_ids == _reference(tiny_loaded, 24)
            assert result.stats.rejected_blocks >= 10, "garbage is counted"
    finally:
        server.stop(None)


def test_unreachable_drafter_falls_back_to_local_prompt_lookup(tiny_loaded):
    core = _verifier(tiny_loaded, draft_wait_ms=5, drafters=("127.0.0.1:1",))
    result = _run(core, "127.0.0.1:1", DraftStrategy.hybrid)  # its draft model is the drafter's
    assert result.token_ids == _reference(tiny_loaded)
    assert result.stats.fallback_steps > 0
    # the verifier's own prompt lookup kept drafting (CONTEXT repeats, so it finds matches)
    assert result.stats.by_proposer["ngram"]["drafted"] > 0
    # suffix decoding: the session's own index runs here too, so it keeps drafting its repeats
    result = _run(core, "127.0.0.1:1", DraftStrategy.suffix, session="x")
    assert result.token_ids == _reference(tiny_loaded)
    assert result.stats.fallback_steps > 0 and result.stats.by_proposer["suffix"]["drafted"] > 0
    # no local stand-in for a draft model: those steps decode plainly
    result = _run(core, "127.0.0.1:1", DraftStrategy.model, session="m")
    assert result.token_ids == _reference(tiny_loaded)
    assert result.stats.drafted == 0 and result.stats.fallback_steps > 0


def _count_waits(remote) -> list:
    """Record every wait of `remote` for a draft block (its condition's timeouts), instead of timing
    peek: whether it waited is a fact, how long it took is the machine's business."""
    waits: list = []
    real = remote._cond.wait
    remote._cond.wait = lambda timeout=None: waits.append(timeout) or real(timeout)
    return waits


def test_a_paused_drafter_is_not_waited_for_and_local_lookup_still_drafts(tiny_loaded):
    """When the verifier asks for no drafts (Commit.next_block_len = 0: a compute-bound batch), the
    drafter sends nothing; the verifier neither waits nor counts a fallback, and its own prompt
    lookup still offers a match."""
    from tandem.engine.speculation.proposers import NgramProposer
    from tandem.services.verifier.drafting import RemoteProposer

    dcore, server, address = _drafter()
    connector = GrpcDrafterConnector()
    try:
        spec = SpecConfig(strategy=DraftStrategy.ngram, max_draft_tokens=4)
        remote = RemoteProposer(connector, address, "p", SamplingParams(), spec, tiny_loaded.vocab_size, wait_s=5.0,
                                local=NgramProposer(1, 4))
        remote.open(CONTEXT)
        first = remote.peek(CONTEXT)  # the drafter's own block, waited for
        assert first.available > 0 and remote.fallback_steps == 0
        ids = CONTEXT + [99]
        remote.on_commit(ids, [99], 0)  # pause
        waits = _count_waits(remote)
        offer = remote.peek(ids)
        assert waits == [], "a paused drafter is not waited for"
        assert offer.proposer == "ngram" and offer.available > 0  # 42 99 occurred before: local lookup
        assert remote.propose(ids, 2, SamplingParams(), None).tokens == NgramProposer(1, 4).propose(ids, 2, SamplingParams(), None).tokens
        assert remote.fallback_steps == 0
        remote.close()
    finally:
        connector.close()
        server.stop(None)


def test_a_suffix_session_drafts_its_own_repeats_here_and_waits_only_for_the_store(tiny_loaded):
    """Suffix decoding's own-index part runs on the verifier too (`local_first`): once the
    drafter's blocks come from the session's own tokens, a step drafts them here, or decodes
    plainly where they have nothing, without waiting; when the drafter's newest block came from its
    store (other sessions' answers, which only it holds), the next step waits for the drafter."""
    from tandem.engine.speculation.suffix import STORE_BUCKET, SuffixProposer
    from tandem.services.verifier.drafting import RemoteProposer

    dcore, server, address = _drafter()
    connector = GrpcDrafterConnector()
    try:
        spec = SpecConfig(strategy=DraftStrategy.suffix, max_draft_tokens=4)
        remote = RemoteProposer(connector, address, "own", SamplingParams(), spec, tiny_loaded.vocab_size,
                                wait_s=5.0, local=SuffixProposer(), local_first=True,
                                target_model=tiny_loaded.model_id, cache_scope=scope_of("t"))
        remote.open(CONTEXT)
        waits = _count_waits(remote)
        first = remote.peek(CONTEXT)  # nothing is known of the drafter's blocks yet: waited for
        assert first.proposer == "suffix" and first.bucket < STORE_BUCKET and waits
        ids = CONTEXT + [99]
        remote.on_commit(ids, [99], 4)
        waits.clear()
        offer = remote.peek(ids)
        assert waits == [], "the session's own repeats are drafted here, not waited for"
        assert offer.available > 0 and remote.fallback_steps == 0
        mine = SuffixProposer().propose(ids, 4, SamplingParams(), None).tokens
        assert remote.propose(ids, 4, SamplingParams(), None).tokens == mine  # what the drafter would draft
        ids = ids + [499]  # never seen: the session's own index has nothing here
        remote.on_commit(ids, [499], 4)
        waits.clear()
        assert remote.peek(ids).available == 0 and waits == [], "no wait for a drafter with nothing from its store"
        assert remote.fallback_steps == 0
        remote.close()

        # The store holds an answer that continues this context: the drafter's block comes from it,
        # and from then on the verifier waits for the drafter's blocks.
        store = dcore.suffix_stores.get(tiny_loaded.model_id, scope_of("t"))
        answer = [400, 401, 402, 403, 404, 405, 406, 407]
        store.add(FRESH, answer)
        remote = RemoteProposer(connector, address, "store", SamplingParams(), spec, tiny_loaded.vocab_size,
                                wait_s=5.0, local=SuffixProposer(), local_first=True,
                                target_model=tiny_loaded.model_id, cache_scope=scope_of("t"))
        remote.open(FRESH)
        offer = remote.peek(FRESH)
        assert offer.bucket >= STORE_BUCKET and remote.propose(FRESH, 4, SamplingParams(), None).tokens == answer[:4]
        ids = FRESH + answer[:2] + [7]  # two accepted, then the target went its own way
        remote.on_commit(ids, ids[len(FRESH):], 4)
        waits = _count_waits(remote)
        remote.peek(ids)
        assert waits, "after a block from the store the next step waits for the drafter"
        remote.close()
    finally:
        connector.close()
        server.stop(None)


def test_prompt_lookup_runs_in_the_verifier_even_with_a_drafter(tiny_loaded):
    """An ngram session drafts with the verifier's own lookup and opens nothing on its (allowed)
    drafter: no stream session, no blocks; the output is the target alone's."""
    dcore, server, address = _drafter()
    try:
        core = _verifier(tiny_loaded, drafters=(address,))
        result = _run(core, address, DraftStrategy.ngram)
        assert result.token_ids == _reference(tiny_loaded)
        assert result.stats.by_proposer["ngram"]["drafted"] > 0 and result.stats.fallback_steps == 0
        assert dcore.stats()["sessions_opened"] == 0 and dcore.stats()["regular_blocks"] == 0
        assert core.connector.streams() == 0, "no stream was opened for it"
    finally:
        server.stop(None)


def _suffix_run(core, address, session: str, salt: str, max_new: int = 40) -> GenerationResult:
    spec = SpecConfig(strategy=DraftStrategy.suffix, adaptive=False, max_draft_tokens=8)
    items = list(core.generate(session, FRESH, SamplingParams(max_new_tokens=max_new, ignore_eos=True), spec,
                               address, cache_salt=salt))
    return items[-1]


FRESH = [300, 301, 302, 303, 304, 305, 306]  # no token twice: the session alone has nothing to copy


def test_a_store_block_runs_past_one_step_and_its_rest_is_used_without_waiting(tiny_loaded):
    """A suffix session asks its drafter for STORE_LOOKAHEAD times a step's drafts: a block that
    follows another session's answer in the store carries more than one step verifies, and the next
    steps take its rest at once instead of waiting a round trip for the next block."""
    from tandem.engine.speculation.suffix import STORE_BUCKET, SuffixProposer
    from tandem.services.verifier.drafting import STORE_LOOKAHEAD, RemoteProposer

    dcore, server, address = _drafter()
    connector = GrpcDrafterConnector()
    try:
        store = dcore.suffix_stores.get(tiny_loaded.model_id, scope_of("t"))
        answer = list(range(400, 424))
        store.add(FRESH, answer)
        k = 4
        spec = SpecConfig(strategy=DraftStrategy.suffix, max_draft_tokens=k)
        remote = RemoteProposer(connector, address, "ahead", SamplingParams(), spec, tiny_loaded.vocab_size,
                                wait_s=5.0, local=SuffixProposer(), local_first=True,
                                target_model=tiny_loaded.model_id, cache_scope=scope_of("t"))
        remote.open(FRESH)
        offer = remote.peek(FRESH)
        assert offer.bucket >= STORE_BUCKET and offer.available > k, "a block past one step's drafts"
        assert offer.available == k * STORE_LOOKAHEAD
        ids, step = list(FRESH), -1
        for step in range(STORE_LOOKAHEAD - 1):
            assert remote.propose(ids, k, SamplingParams(), None).tokens == answer[step * (k + 1):][:k]
            ids = FRESH + answer[: (step + 1) * (k + 1)]  # k accepted and the bonus, as the store said
            remote.on_commit(ids, answer[step * (k + 1): (step + 1) * (k + 1)], k)
            waits = _count_waits(remote)
            offer = remote.peek(ids)
            if offer.available < 1:
                break
            assert waits == [], f"step {step + 2} took the rest of the block without waiting"
            assert offer.bucket >= STORE_BUCKET
        assert step >= 1, "the rest of one block served at least two more steps"
        remote.close()
    finally:
        connector.close()
        server.stop(None)


def test_the_drafters_suffix_store_serves_sessions_of_two_verifiers_and_never_another_tenant(tiny_loaded):
    """One drafter, two verifiers: a response finished through verifier 1 is drafted for a new
    session with the same prompt on verifier 2 (same tenant), and the text is the target's.
    The same prompt from another tenant gets none of it: its store is its own."""
    dcore, server, address = _drafter(None)
    try:
        v1, v2 = _verifier(tiny_loaded, verifier_id="v1", drafters=(address,)), \
            _verifier(tiny_loaded, verifier_id="v2", drafters=(address,))
        want = Engine(tiny_loaded).generate(FRESH, SamplingParams(max_new_tokens=40, ignore_eos=True),
                                            SpecConfig(strategy=DraftStrategy.none)).token_ids
        first = _suffix_run(v1, address, "a1", "tenant-a")
        assert first.token_ids == want
        _until(lambda: dcore.stats()["suffix"]["responses"] == 1)  # the close reaches the drafter
        second = _suffix_run(v2, address, "a2", "tenant-a")
        other = _suffix_run(v2, address, "b1", "tenant-b")
        assert second.token_ids == want and other.token_ids == want
        from_store = second.stats.by_proposer["suffix"]["accepted"]
        assert from_store >= 0.7 * len(want), second.stats  # nearly all of it drafted from the first answer
        assert second.stats.steps < first.stats.steps / 2
        # tenant b: only what its own session repeats (the tiny model loops), nothing from a's answer
        assert other.stats.steps == first.stats.steps and other.stats.drafted == first.stats.drafted
        assert dcore.stats()["suffix"]["stores"] == 2
        _until(lambda: dcore.stats()["suffix"]["responses"] == 3)
        from prometheus_client import generate_latest

        from tandem.serving.metrics import DrafterMetrics

        scraped = generate_latest(DrafterMetrics(dcore.stats).registry).decode()
        assert "tandem_suffix_store_responses 3.0" in scraped and "tandem_suffix_stores 2.0" in scraped
    finally:
        server.stop(None)


def _until(ok, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_token_trees_over_the_wire_commit_the_targets_text(tiny_loaded, monkeypatch, measured_gemm):
    """The drafter's store holds two answers to one prompt that fork: its suffix decoding sends
    token trees (DraftBlock.parents) to the verifier, which verifies them in one forward each;
    the text is the target's. With trees switched off on the drafter, chains only, same text."""
    from tandem.engine.scheduler.runner import Sequence

    calls = []
    real = Sequence.tree_rows  # every token tree a step verifies, in process or in the step loop
    monkeypatch.setattr(Sequence, "tree_rows", staticmethod(lambda p: calls.append(list(p)) or real(p)))
    want = Engine(tiny_loaded).generate(FRESH, SamplingParams(max_new_tokens=40, ignore_eos=True),
                                        SpecConfig(strategy=DraftStrategy.none)).token_ids
    for trees in (True, False):
        dcore = DrafterCore(DrafterSettings(drafter_id="d-trees", suffix_trees=trees))
        server, bound = build_drafter(dcore, "127.0.0.1:0")
        server.start()
        address = f"127.0.0.1:{bound}"
        try:
            store = dcore.suffix_stores.get(tiny_loaded.model_id, scope_of("tenant-a"))
            fork = 10
            store.add(FRESH, want)
            store.add(FRESH, want[:fork] + [(want[fork] + 1) % 500] + want[fork:])
            core = _verifier(tiny_loaded, drafters=(address,))
            calls.clear()
            result = _suffix_run(core, address, f"t-{trees}", "tenant-a")
            assert result.token_ids == want
            if trees:
                assert any(p != list(range(-1, len(p) - 1)) for p in calls), calls  # a real fork was verified
            else:
                assert calls == []
        finally:
            server.stop(None)


def test_one_draft_stream_carries_64_concurrent_sessions(tiny_loaded):
    """64 sessions of one verifier draft through one drafter at once, on one stream, with fewer
    drafter workers than sessions: all complete, each equal to the target alone, and the drafter
    saw one stream."""
    import threading

    dcore = DrafterCore(DrafterSettings(drafter_id="d-64", draft_workers=4))
    server, bound = build_drafter(dcore, "127.0.0.1:0", max_workers=4)  # far below 64: no stream per session
    server.start()
    address = f"127.0.0.1:{bound}"
    try:
        core = _verifier(tiny_loaded, drafters=(address,), max_sessions=64, draft_wait_ms=50)
        spec = SpecConfig(strategy=DraftStrategy.suffix, adaptive=False, max_draft_tokens=3)  # the drafter's
        contexts = [CONTEXT[i % 7:] + CONTEXT[: i % 7] + [10 + i] for i in range(64)]
        results: dict[int, GenerationResult] = {}
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                items = list(core.generate(f"s{i}", contexts[i], SamplingParams(max_new_tokens=12), spec, address))
                results[i] = items[-1]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and len(results) == 64
        assert core.connector.streams() == 1, "one stream to the drafter carried every session"
        for i, result in results.items():
            expected = Engine(tiny_loaded).generate(contexts[i], SamplingParams(max_new_tokens=12),
                                                    SpecConfig(strategy=DraftStrategy.none)).token_ids
            assert result.token_ids == expected, i
        assert sum(r.stats.drafted for r in results.values()) > 0, "the drafter drafted"
        assert dcore.stats()["sessions_opened"] == 64
    finally:
        server.stop(None)


def test_a_slow_session_does_not_hold_back_the_others_on_the_shared_stream(tiny_loaded):
    """Two sessions on one stream; the drafter's drafting for one of them is made slow (a real
    draft blocked on an event). The other's blocks keep arriving: its generation completes with
    drafts while the slow one is still stuck."""
    import threading

    dcore = DrafterCore(DrafterSettings(drafter_id="d-slow", draft_workers=4))
    gate = threading.Event()
    original = dcore._draft_regular

    def slow(session):  # the drafter's own drafting, for session "slow" only after the gate
        if session.session_id == "slow":
            gate.wait(30)
        return original(session)

    dcore._draft_regular = slow
    server, bound = build_drafter(dcore, "127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{bound}"
    try:
        core = _verifier(tiny_loaded, drafters=(address,), draft_wait_ms=50)
        spec = SpecConfig(strategy=DraftStrategy.suffix, adaptive=False, max_draft_tokens=3)  # the drafter's
        slow_done = threading.Event()
        t = threading.Thread(target=lambda: (list(core.generate("slow", CONTEXT, SamplingParams(max_new_tokens=8),
                                                                spec, address)), slow_done.set()))
        t.start()
        # suffix: drafted on the drafter only (a verifier with others busy would prompt-look-up locally)
        fast = _run(core, address, DraftStrategy.suffix, max_new=24, session="fast")
        assert not gate.is_set()
        assert fast.stats.drafted > 0 and fast.stats.fallback_steps < fast.stats.steps, \
            "the fast session got its drafts while the slow one's drafting was stuck"
        assert fast.token_ids == _reference(tiny_loaded, 24)
        gate.set()
        t.join(60)
        assert slow_done.is_set()
    finally:
        gate.set()
        server.stop(None)


def test_without_a_drafter_hybrid_and_model_decode_the_targets_text(tiny_loaded):
    """A request for hybrid or model that reaches a verifier without a drafter address (the gateway
    saw no drafter offering it: one restarting, or too busy to answer its poll) and without a draft
    model of its own is served, not refused: hybrid drafts with prompt lookup here, model decodes
    plainly; the text is the target's either way."""
    want = Engine(tiny_loaded).generate(CONTEXT, SamplingParams(max_new_tokens=32),
                                        SpecConfig(strategy=DraftStrategy.none)).token_ids
    core = _verifier(tiny_loaded)
    assert core.engine.factory.draft_model is None
    for strategy in (DraftStrategy.hybrid, DraftStrategy.model):
        result = _run(core, "", strategy, session=f"no-drafter-{strategy.value}")
        assert result.token_ids == want, strategy
        if strategy == DraftStrategy.model:
            assert result.stats.drafted == 0
