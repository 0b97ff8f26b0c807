"""The drafter service over real gRPC sockets: a server on 127.0.0.1 port 0 and a real channel.

Checked: blocks are what the proposers draft, based where the protocol says; draft-ahead blocks
are usable exactly when their guess is committed; sampled proposals are valid distributions; an
error about one session leaves the others on the stream working; cancellation and server stop free
every session; health checking and reflection answer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.contract.params import DraftStrategy, SamplingParams
from tandem.engine.speculation.proposers import DraftModelProposer, NgramProposer
from tandem.services.drafter.core import DrafterCore, InvalidRequest, Overloaded
from tandem.services.drafter.server import build_server, serve
from tandem.services.drafter.settings import DrafterSettings
from tandem.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

VOCAB = 512
PATTERN = list(range(20, 30))
CONTEXT = PATTERN + PATTERN[:3]  # the suffix 20 21 22 occurred before: prompt lookup proposes 23 24 ...


class DraftStream:
    """The verifier's side of one Draft stream: requests go in through a queue."""

    def __init__(self, channel: grpc.Channel, timeout: float = 20.0):
        self._requests: queue.Queue[drafter_pb2.DraftRequest | None] = queue.Queue()
        self.call = drafter_pb2_grpc.DrafterStub(channel).Draft(iter(self._requests.get, None), timeout=timeout)

    def open(self, sid: str, context: list[int], *, next_block_len: int = 4, strategy=common_pb2.DRAFT_STRATEGY_NGRAM,
             vocab_size: int = VOCAB, sampling: common_pb2.SamplingParams | None = None) -> None:
        self._requests.put(drafter_pb2.DraftRequest(session_id=sid, open=drafter_pb2.OpenSession(
            context_ids=context, strategy=strategy, max_draft_tokens=8, sampling=sampling,
            vocab_size=vocab_size, next_block_len=next_block_len)))

    def commit(self, sid: str, committed_len: int, appended: list[int], next_block_len: int = 4) -> None:
        self._requests.put(drafter_pb2.DraftRequest(session_id=sid, commit=drafter_pb2.Commit(
            committed_len=committed_len, appended_ids=appended, next_block_len=next_block_len)))

    def close(self, sid: str) -> None:
        self._requests.put(drafter_pb2.DraftRequest(session_id=sid, close=drafter_pb2.CloseSession(reason="finished")))

    def next(self) -> drafter_pb2.DraftBlock:
        return next(self.call)

    def hang_up(self) -> None:
        """Let the channel's request thread finish after the call ended otherwise."""
        self._requests.put(None)

    def end(self) -> list[drafter_pb2.DraftBlock]:
        """Half-close; return whatever the drafter still sends."""
        self._requests.put(None)
        return list(self.call)


def usable(block: drafter_pb2.DraftBlock, ids: list[int]) -> bool:
    """The verifier's rule (drafter.proto, DraftBlock): not based past the committed length, its
    leading drafts equal the committed tokens they overlap, and something left to verify."""
    skip = len(ids) - block.base_len
    return 0 <= skip < len(block.token_ids) and list(block.token_ids[:skip]) == ids[block.base_len :]


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _serve(settings: DrafterSettings) -> Iterator[tuple[DrafterCore, grpc.Channel]]:
    core = DrafterCore(settings)
    server, port = build_server(core)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield core, channel
    finally:
        channel.close()
        server.stop(grace=1.0).wait(timeout=5.0)


@pytest.fixture
def ngram_drafter() -> Iterator[tuple[DrafterCore, grpc.Channel]]:
    yield from _serve(DrafterSettings(drafter_id="d-ngram"))


@pytest.fixture
def model_drafter(tiny_draft_loaded) -> Iterator[tuple[DrafterCore, grpc.Channel]]:
    yield from _serve(DrafterSettings(drafter_id="d-model", draft_model=tiny_draft_loaded))


def test_ngram_open_commit_close(ngram_drafter) -> None:
    core, channel = ngram_drafter
    stream = DraftStream(channel)
    stream.open("s", CONTEXT)
    block = stream.next()
    expected = NgramProposer(1, 4).propose(CONTEXT, 4, SamplingParams(), None)
    assert (block.session_id, block.base_len, block.speculative) == ("s", len(CONTEXT), False)
    assert list(block.token_ids) == expected.tokens == [23, 24, 25, 26]
    assert block.proposer == "ngram" and block.confidence == expected.bucket == 3
    assert not block.proposals  # deterministic: q is one-hot
    ahead = stream.next()
    assert ahead.speculative and ahead.base_len == len(CONTEXT) + 4
    assert all(0 <= t < VOCAB for b in (block, ahead) for t in b.token_ids)
    assert core.stats()["active_sessions"] == 1

    # Worked example of drafter.proto: accept 23 24, recover 20 -> a fresh block at 16.
    stream.commit("s", 16, [23, 24, 20])
    fresh = stream.next()
    ids = CONTEXT + [23, 24, 20]
    assert (fresh.base_len, fresh.speculative) == (16, False)
    assert list(fresh.token_ids) == NgramProposer(1, 4).propose(ids, 4, SamplingParams(), None).tokens
    stream.close("s")
    assert all(b.speculative for b in stream.end())  # at most the draft-ahead of `fresh`
    assert stream.call.code() == grpc.StatusCode.OK
    assert core.stats()["active_sessions"] == 0


def test_draft_ahead_is_used_when_its_guess_is_committed(ngram_drafter) -> None:
    core, channel = ngram_drafter
    stream = DraftStream(channel)
    stream.open("s", CONTEXT)
    block, ahead = stream.next(), stream.next()
    # The guess: the continuation after the match's drafts (27 follows 26 in the context).
    assert (ahead.base_len, list(ahead.token_ids)) == (17, [27, 28, 29, 20, 21])

    # The verifier accepts the whole block and its bonus is the guessed 27.
    ids = CONTEXT + list(block.token_ids) + [27]
    assert usable(ahead, ids)
    stream.commit("s", len(ids), list(block.token_ids) + [27])
    nxt = stream.next()  # no fresh regular block: the next thing sent drafts past `ahead`
    assert nxt.speculative and nxt.base_len == ahead.base_len + len(ahead.token_ids)
    # It assumes `ahead` accepted whole: with that and its own guess, it is usable in turn.
    ids += list(ahead.token_ids[1:]) + [nxt.token_ids[0]]
    assert usable(nxt, ids)
    stream.commit("s", len(ids), ids[18:])
    assert stream.next().base_len == nxt.base_len + len(nxt.token_ids)

    # A rejection: 23 is accepted, 20 recovered; the pending block is stale, a fresh one comes.
    ids += [23, 20]
    stream.commit("s", len(ids), [23, 20])
    fresh = stream.next()
    assert (fresh.base_len, fresh.speculative) == (len(ids), False)
    stream.end()  # closes the session: a draft-ahead still pending counts as wasted
    stats = core.stats()
    assert stats["regular_blocks"] == 2 and stats["speculative_used"] == 2
    assert stats["speculative_wasted"] == stats["speculative_blocks"] - 2 >= 1
    assert 0 < stats["hidden_fraction"] < 1


def test_sampled_model_blocks_carry_their_proposals(model_drafter, tiny_draft_loaded) -> None:
    core, channel = model_drafter
    stream = DraftStream(channel)
    sampling = common_pb2.SamplingParams(temperature=0.8, seed=5)
    stream.open("a", CONTEXT, strategy=common_pb2.DRAFT_STRATEGY_MODEL, sampling=sampling)
    stream.open("b", CONTEXT, strategy=common_pb2.DRAFT_STRATEGY_MODEL, sampling=sampling)
    # a: regular, speculative; b: the same. Sessions draft concurrently, so their blocks may
    # interleave; each session's come in order.
    blocks = [stream.next() for _ in range(4)]
    for block in blocks:
        assert block.proposer == "model" and len(block.proposals) == len(block.token_ids) > 0
        for tok, q in zip(block.token_ids, block.proposals):
            assert tok in q.token_ids and all(0 <= t < VOCAB for t in q.token_ids)
            assert all(p > 0 for p in q.probs) and sum(q.probs) == pytest.approx(1.0, abs=1e-5)
    by_session = {sid: [blk for blk in blocks if blk.session_id == sid] for sid in ("a", "b")}
    (a, a_ahead), (b, _) = by_session["a"], by_session["b"]
    assert (a.base_len, a_ahead.base_len, a_ahead.speculative) == (13, 13 + len(a.token_ids), True)
    assert list(a.token_ids) == list(b.token_ids)  # same seed, same context: same draws

    # Greedy drafts equal the draft model's own greedy proposal, clipped to the target vocabulary.
    small_vocab = 300
    stream.open("g", CONTEXT, strategy=common_pb2.DRAFT_STRATEGY_MODEL, vocab_size=small_vocab)
    greedy = stream.next()
    direct = DraftModelProposer(tiny_draft_loaded, vocab_limit=small_vocab, stop_below=0.0).propose(CONTEXT, 4, SamplingParams(), None)
    assert list(greedy.token_ids) == direct.tokens and not greedy.proposals
    assert all(0 <= t < small_vocab for t in greedy.token_ids)
    stream.end()
    assert core.stats()["active_sessions"] == 0


def test_model_blocks_follow_the_requests_grammar(model_drafter, tiny_draft_loaded) -> None:
    """The verifier passes the request's grammar in OpenSession.sampling: the drafter's model masks
    its drafts by it, so its regular block and the block it drafts ahead (after the regular
    block's drafts) are both inside the grammar, and after a commit the next block continues it."""
    from tandem.contract.params import Grammar
    from tandem.engine.speculation.grammar import Constraint

    core, channel = model_drafter
    regex = r"(yes|no|maybe)(,(yes|no|maybe)){2,6}"
    stream = DraftStream(channel)
    stream.open("g", CONTEXT, strategy=common_pb2.DRAFT_STRATEGY_MODEL, next_block_len=4,
                sampling=common_pb2.SamplingParams(grammar=common_pb2.GrammarConstraint(regex=regex)))
    regular, ahead = stream.next(), stream.next()

    def inside(generated: list[int], block: list[int]) -> bool:
        c = Constraint(Grammar(kind="regex", value=regex), tiny_draft_loaded.tokenizer, VOCAB,
                       sorted(tiny_draft_loaded.eos_token_ids))
        c.advance(generated)
        return all(c.matcher.accept_token(t) for t in block)

    assert regular.token_ids and inside([], list(regular.token_ids))
    assert ahead.speculative and inside(list(regular.token_ids), list(ahead.token_ids))
    free = DraftModelProposer(tiny_draft_loaded, vocab_limit=VOCAB, stop_below=0.0).propose(CONTEXT, 4, SamplingParams(), None)
    assert not inside([], free.tokens), "unmasked, the draft model leaves the grammar: else this shows nothing"
    first = list(regular.token_ids[:1])
    stream.commit("g", len(CONTEXT) + 1, first)  # only the first draft accepted: the guess failed
    after = stream.next()
    while after.speculative or after.base_len != len(CONTEXT) + 1:
        after = stream.next()
    assert inside(first, list(after.token_ids))
    stream.end()


def test_hybrid_blocks_come_from_a_match_on_long_matches_else_the_model(model_drafter, tiny_draft_loaded) -> None:
    core, channel = model_drafter
    assert common_pb2.DRAFT_STRATEGY_HYBRID in drafter_pb2_grpc.DrafterStub(channel).GetInfo(
        drafter_pb2.DrafterInfoRequest(), timeout=5).strategies
    stream = DraftStream(channel)
    # CONTEXT ends in a 3-token match (20 21 22): at the default minimum of 3 a match drafts,
    # suffix decoding's first (it sees what prompt lookup sees, with counts)
    stream.open("h", CONTEXT, strategy=common_pb2.DRAFT_STRATEGY_HYBRID)
    block = stream.next()
    assert block.proposer == "suffix" and list(block.token_ids) == [23, 24, 25, 26] and block.confidence == 3
    # a context whose last token never occurred before: no match, the model drafts
    fresh = [5, 6, 7, 8, 9, 10]
    stream.open("m", fresh, strategy=common_pb2.DRAFT_STRATEGY_HYBRID)
    blocks = [stream.next() for _ in range(3)]
    mine = next(b for b in blocks if b.session_id == "m" and not b.speculative)
    direct = DraftModelProposer(tiny_draft_loaded, vocab_limit=VOCAB, stop_below=0.0).propose(fresh, 4, SamplingParams(), None)
    assert mine.proposer == "model" and list(mine.token_ids) == direct.tokens
    stream.end()
    assert core.stats()["active_sessions"] == 0


def test_hybrid_needs_a_draft_model(ngram_drafter) -> None:
    core, _ = ngram_drafter
    with pytest.raises(InvalidRequest, match="hybrid.*no draft model"):
        list(core.open("s", CONTEXT, DraftStrategy.hybrid, 8, SamplingParams(), VOCAB, 4))


def test_draft_ahead_hides_drafting_when_the_target_agrees(model_drafter, tiny_draft_loaded) -> None:
    """A verifier whose target is the draft model itself (greedy) accepts every draft and commits
    the guessed bonus, so after the first block every block it verifies is a draft-ahead block,
    and its output is plain greedy decoding."""
    core, channel = model_drafter
    model = tiny_draft_loaded.model

    @torch.inference_mode()
    def target_next(ids: list[int]) -> int:
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())

    stream = DraftStream(channel)
    ids = CONTEXT[:6]
    stream.open("s", ids, strategy=common_pb2.DRAFT_STRATEGY_MODEL)
    block = stream.next()
    for step in range(5):
        if step:
            block = stream.next()
            assert block.speculative and usable(block, ids)  # no fresh regular block was needed
        drafts = list(block.token_ids[len(ids) - block.base_len :])
        appended: list[int] = []
        for draft in drafts + [None]:  # verify each draft, then the bonus
            appended.append(target_next(ids + appended))
            if appended[-1] != draft:
                break
        assert appended[:-1] == drafts  # all accepted
        ids = ids + appended
        stream.commit("s", len(ids), appended)
    stream.end()
    plain = CONTEXT[:6]
    while len(plain) < len(ids):
        plain.append(target_next(plain))
    assert ids == plain
    stats = core.stats()
    assert (stats["speculative_used"], stats["speculative_wasted"], stats["regular_blocks"]) == (5, 1, 1)
    assert stats["hidden_fraction"] > 0.5


def test_a_bad_message_drops_only_its_session(ngram_drafter, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tandem.drafter")
    core, channel = ngram_drafter
    stream = DraftStream(channel)
    stream.open("a", CONTEXT, next_block_len=0)
    stream.open("b", CONTEXT, next_block_len=0)
    stream.commit("a", 99, [23, 24])  # wrong: 13 + 2 = 15
    stream.commit("a", 16, [25])  # a is gone now: dropped as NOT_FOUND, quietly
    stream.open("m", CONTEXT, strategy=common_pb2.DRAFT_STRATEGY_MODEL)  # no draft model here
    stream.commit("b", 15, [23, 24])
    block = stream.next()  # the stream lives: b's block is the first thing sent
    assert (block.session_id, block.base_len) == ("b", 15)
    assert "committed_len 99 does not match the previous committed length 13 + 2 appended ids = 15" in caplog.text
    assert "strategy 'model' but drafter d-ngram has no draft model" in caplog.text
    stats = core.stats()
    assert stats["session_errors"] == {"INVALID_ARGUMENT": 2, "NOT_FOUND": 1}
    assert stats["active_sessions"] == 1  # only b
    stream.end()
    assert stream.call.code() == grpc.StatusCode.OK


def test_a_message_without_session_ends_the_stream(ngram_drafter) -> None:
    core, channel = ngram_drafter
    stream = DraftStream(channel)
    stream.open("s", CONTEXT, next_block_len=0)
    stream._requests.put(drafter_pb2.DraftRequest(commit=drafter_pb2.Commit(committed_len=14, appended_ids=[23])))
    with pytest.raises(grpc.RpcError) as failure:
        stream.next()
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "without session_id" in failure.value.details()
    stream.hang_up()
    assert wait_for(lambda: core.stats()["active_sessions"] == 0)


def test_core_errors_name_the_numbers() -> None:
    core = DrafterCore(DrafterSettings(max_sessions=1))
    core.open("s", CONTEXT, DraftStrategy.ngram, 8, SamplingParams(), VOCAB, 0)
    with pytest.raises(InvalidRequest, match="committed_len 20 does not match .* 13 \\+ 1 appended ids = 14"):
        core.commit("s", 20, [1], 4)
    with pytest.raises(InvalidRequest, match="appended_ids holds id 600, outside \\[0, 512\\)"):
        core.commit("s", 14, [600], 4)
    with pytest.raises(Overloaded, match="max_sessions=1"):
        core.open("t", CONTEXT, DraftStrategy.ngram, 8, SamplingParams(), VOCAB, 0)


@pytest.fixture
def short_drafter() -> Iterator[tuple[DrafterCore, grpc.Channel]]:
    yield from _serve(DrafterSettings(drafter_id="d-short", max_context_tokens=len(CONTEXT) + 3))


def test_a_session_past_max_context_tokens_is_dropped_and_the_stream_goes_on(short_drafter, caplog) -> None:
    """Prompt lookup indexes every committed token, so a session's length is the drafter's memory
    and time: an Open or a Commit past the limit drops that session alone (INVALID_ARGUMENT, the
    verifier decodes it plainly), and the same stream keeps drafting for the others."""
    caplog.set_level(logging.WARNING, logger="tandem.drafter")
    core, channel = short_drafter
    limit = core.settings.max_context_tokens  # 16
    stream = DraftStream(channel)
    stream.open("big", CONTEXT + PATTERN)  # 23 tokens
    stream.open("s", CONTEXT)
    block = stream.next()  # nothing was sent for "big": the first block is s's
    assert (block.session_id, block.base_len, list(block.token_ids)) == ("s", len(CONTEXT), [23, 24, 25, 26])
    assert stream.next().speculative
    stream.commit("s", limit, [23, 24, 25], next_block_len=0)  # exactly at the limit: fine
    stream.commit("s", limit + 1, [26])  # one past it: s is dropped
    stream.open("edge", (CONTEXT + PATTERN)[:limit])
    block = stream.next()
    assert (block.session_id, block.base_len) == ("edge", limit)
    assert "session big: context_ids holds 23 tokens, above drafter d-short's max_context_tokens=16" in caplog.text
    assert ("session s: committing 1 ids would grow it to 17 tokens, above drafter d-short's "
            "max_context_tokens=16") in caplog.text
    stats = core.stats()
    assert stats["session_errors"] == {"INVALID_ARGUMENT": 2}
    assert stats["active_sessions"] == 1  # only edge
    stream.end()
    assert stream.call.code() == grpc.StatusCode.OK


def test_the_default_context_limit_bounds_one_open() -> None:
    core = DrafterCore(DrafterSettings())
    with pytest.raises(InvalidRequest, match="holds 131073 tokens, above drafter .*'s max_context_tokens=131072"):
        core.open("huge", [7] * 131073, DraftStrategy.ngram, 8, SamplingParams(), VOCAB, 4)
    assert core.stats()["active_sessions"] == 0


def test_the_draft_model_drafts_only_inside_its_context_window(tiny_draft_loaded) -> None:
    """Past its window a draft model's drafts would be noise, and its attention over a context
    whose length the caller chooses costs quadratic time and memory: model drafts nothing there,
    hybrid drafts by prompt lookup alone, and no block runs past the window."""
    core = DrafterCore(DrafterSettings(draft_model=tiny_draft_loaded, lookahead=False))
    window = tiny_draft_loaded.max_context
    past = (PATTERN * (window // len(PATTERN) + 2))[: window + 3]  # its suffix occurred before
    [block] = core.open("m", past, DraftStrategy.model, 8, SamplingParams(), VOCAB, 4)
    assert (block.base_len, block.token_ids) == (window + 3, [])  # said so: the verifier decodes plainly
    [block] = core.open("h", past, DraftStrategy.hybrid, 8, SamplingParams(), VOCAB, 4)
    assert block.proposer == "ngram"
    assert block.token_ids == NgramProposer(1, 4).propose(past, 4, SamplingParams(), None).tokens
    [block] = core.open("edge", [5, 6, 7, 9] * (window // 4 - 1) + [5, 8], DraftStrategy.model, 8, SamplingParams(),
                        VOCAB, 8)
    assert len(block.token_ids) == window - block.base_len == 2  # not 8: the window ends 2 positions on


def test_cancel_frees_the_streams_sessions(ngram_drafter) -> None:
    core, channel = ngram_drafter
    stream = DraftStream(channel)
    stream.open("a", CONTEXT)
    stream.open("b", CONTEXT)
    stream.next()
    assert wait_for(lambda: core.stats()["active_sessions"] == 2)
    stream.call.cancel()
    with pytest.raises(grpc.RpcError):
        list(stream.call)
    assert stream.call.code() == grpc.StatusCode.CANCELLED
    stream.hang_up()
    assert wait_for(lambda: core.stats()["active_sessions"] == 0)


def test_health_reflection_and_info(ngram_drafter) -> None:
    core, channel = ngram_drafter
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.v1.Drafter"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"tandem.v1.Drafter", "grpc.health.v1.Health"} <= names
    info = drafter_pb2_grpc.DrafterStub(channel).GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=5)
    assert (info.drafter_id, list(info.strategies), info.model_id, info.vocab_size) == (
        "d-ngram", [common_pb2.DRAFT_STRATEGY_NGRAM, common_pb2.DRAFT_STRATEGY_SUFFIX], "", 0)


def test_graceful_stop_ends_open_streams_and_frees_them() -> None:
    core = DrafterCore(DrafterSettings())
    server, port = build_server(core)
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = DraftStream(channel)
        stream.open("s", CONTEXT)
        stream.next()
        started = time.monotonic()
        assert server.stop(grace=0.3).wait(timeout=5.0)
        assert time.monotonic() - started < 3.0
        with pytest.raises(grpc.RpcError):
            list(stream.call)
        stream.hang_up()
    assert wait_for(lambda: core.stats()["active_sessions"] == 0)


def test_serve_runs_until_stopped() -> None:
    stop, ready = threading.Event(), queue.Queue()
    thread = threading.Thread(
        target=serve, args=(DrafterSettings(),), kwargs=dict(address="127.0.0.1:0", grace_s=0.5, stop=stop,
                                                             on_ready=ready.put), daemon=True)
    thread.start()
    port = ready.get(timeout=10)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()


def _count_feeds(monkeypatch) -> list[int]:
    """The token counts of the draft model's feeds from now on (every proposer's, in this process)."""
    from tandem.engine.speculation import proposers

    fed: list[int] = []
    real = proposers._DraftLM.feed

    def feed(self, tokens):
        fed.append(len(tokens))
        return real(self, tokens)

    monkeypatch.setattr(proposers._DraftLM, "feed", feed)
    return fed


def test_a_finished_sessions_next_turn_reads_only_its_new_tokens(tiny_draft_loaded, monkeypatch) -> None:
    """An agent's next turn re-opens its session with the whole conversation: the drafter resumes
    the parked proposer, whose draft model then reads the turn's new tokens, not the conversation
    again. Another stream opening the same session id (another verifier) gets none of it."""
    served = _serve(DrafterSettings(drafter_id="d-park", draft_model=tiny_draft_loaded, lookahead=False))
    core, channel = next(served)
    try:
        fed = _count_feeds(monkeypatch)
        turn1 = [(7 * i + 3) % VOCAB for i in range(300)]
        stream = DraftStream(channel)
        stream.open("agent", turn1, strategy=common_pb2.DRAFT_STRATEGY_MODEL)
        first = stream.next()
        assert first.base_len == 300 and first.token_ids
        assert max(fed) >= 299  # the first turn reads its context
        stream.commit("agent", 303, [11, 12, 13])
        stream.next()
        ids = turn1 + [11, 12, 13]
        stream.close("agent")
        assert wait_for(lambda: core.stats()["parked_sessions"] == 1)
        assert core.stats()["parked_tokens"] == len(ids)

        fed.clear()
        turn2 = ids + [40, 41, 42, 43, 44]  # the reply, then the next user message
        stream.open("agent", turn2, strategy=common_pb2.DRAFT_STRATEGY_MODEL)
        block = stream.next()
        assert block.base_len == len(turn2) and block.token_ids
        assert max(fed) <= 6, fed  # the 5 new tokens (and the last one again), not 308
        stats = core.stats()
        assert (stats["sessions_resumed"], stats["parked_sessions"]) == (1, 0)

        stream.close("agent")
        assert wait_for(lambda: core.stats()["parked_sessions"] == 1)
        other = DraftStream(channel)  # another verifier's stream, the same session id
        fed.clear()
        other.open("agent", turn2, strategy=common_pb2.DRAFT_STRATEGY_MODEL)
        other.next()
        assert max(fed) >= len(turn2) - 1  # read from scratch: nothing of the first stream's
        assert core.stats()["sessions_resumed"] == 1
        other.end()
        stream.end()
        # a stream that ends takes its parked sessions with it: no later turn can reach them
        assert wait_for(lambda: core.stats()["parked_sessions"] == 0)
    finally:
        served.close()


def test_parked_sessions_are_bounded_and_keyed_by_everything_they_were_built_for(tiny_draft_loaded) -> None:
    """Oldest first out past parked_sessions or parked_tokens; a session dropped after an error is
    not kept; a re-open for another tenant scope, target model or strategy builds afresh."""
    core = DrafterCore(DrafterSettings(draft_model=tiny_draft_loaded, lookahead=False, parked_sessions=2,
                                       parked_tokens=100))
    ctx = CONTEXT * 2  # 26 tokens

    def turn(sid, *, owner="v1", scope="", model="m", strategy=DraftStrategy.ngram, context=ctx):
        list(core.open(sid, context, strategy, 8, SamplingParams(), VOCAB, 4, owner=owner, target_model=model,
                       cache_scope=scope))
        return core.stats()["sessions_resumed"]

    for sid in ("a", "b", "c"):
        turn(sid)
        core.close(sid, owner="v1", finished=True)
    stats = core.stats()
    assert (stats["parked_sessions"], stats["parked_tokens"]) == (2, 2 * len(ctx))  # "a" went first
    assert turn("a") == 0 and turn("b") == 1  # "b" resumed: a parked proposer serves one next turn
    core.close("a", owner="v1", finished=True)
    core.close("b", owner="v1", finished=True)  # parked: "a", "b" ("c" went first)
    for kwargs in ({"scope": "tenant-2"}, {"model": "other"}, {"strategy": DraftStrategy.suffix}, {"owner": "v2"}):
        assert turn("b", **kwargs) == 1, kwargs  # built afresh
        core.close("b", owner=kwargs.get("owner", "v1"), error="INVALID_ARGUMENT")  # dropped: not parked
    assert turn("b") == 2  # the one parked for exactly this is still there
    core.close("b", owner="v1", finished=True)
    long = [(5 * i) % VOCAB for i in range(101)]  # above parked_tokens alone: not kept
    turn("long", context=long)
    core.close("long", owner="v1", finished=True)
    assert "long" not in {key[1] for key in core._parked}
    assert core.stats()["parked_tokens"] <= 100


def test_the_draft_window_setting_reaches_every_draft_model_proposer(tiny_draft_loaded) -> None:
    """--draft-context sets how much of a session the draft model reads when it starts on it, for
    the model and the hybrid alike; None reads all of it."""
    for window in (8, None):
        core = DrafterCore(DrafterSettings(draft_model=tiny_draft_loaded, draft_context=window))
        model = core._proposer(DraftStrategy.model, VOCAB, None)
        hybrid = core._proposer(DraftStrategy.hybrid, VOCAB, None, store=None)
        assert model.context == hybrid.model.context == window
    with pytest.raises(ValueError):
        DrafterSettings(draft_context=0)



def test_a_near_greedy_sampled_draft_lists_only_tokens_it_could_draw(model_drafter) -> None:
    """At temperature 1e-30 the draft model's top-k holds tokens whose probability underflowed to
    0; a proposal lists only positive ones (the wire's promise), the drafted token among them.
    (Found by `make fuzz`: its random campaign drew temperature 1e-30.)"""
    _, channel = model_drafter
    stream = DraftStream(channel)
    stream.open("z", CONTEXT, strategy=common_pb2.DRAFT_STRATEGY_MODEL,
                sampling=common_pb2.SamplingParams(temperature=1e-30, max_new_tokens=8))
    block = stream.next()
    assert block.proposals and len(block.proposals) == len(block.token_ids)
    for tok, q in zip(block.token_ids, block.proposals):
        assert tok in q.token_ids and len(q.token_ids) == len(q.probs) and all(p > 0 for p in q.probs)
    stream.end()
