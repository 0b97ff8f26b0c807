"""Hostile input at the gRPC edge: hypothesis-generated messages against a real verifier and a
real drafter over real sockets.

Every interface is an attack surface: a peer may send any int32 as an enum, NaN as a temperature,
ids outside the vocabulary, 2**32 - 1 as a length, strings of any size, messages in any order.
What each call must do, whatever it is sent:
- end with OK or a client-error status (INVALID_ARGUMENT, NOT_FOUND, ...), never UNKNOWN or
  INTERNAL (a servicer that let an exception escape), never hang (every call carries a deadline,
  and DEADLINE_EXCEEDED fails the test);
- when it ends OK, keep the contract: greedy output equal to the target's own greedy output,
  committed tokens streamed once each in order, drafted ids inside the session's vocabulary;
- leave the server as it was: afterwards a normal request is served correctly, no session leaks,
  no thread died.

The verifier also meets a hostile drafter: a scripted one whose blocks are drawn by hypothesis
(stale, for other sessions, ids outside the vocabulary, malformed proposal distributions, or the
target's own tokens so that some are accepted). Drafts change speed, never text: the output must
stay the target's.

Example counts are bounded and the generation derandomized, so CI runs the same examples every
time (about 15 s on 2 cores). The verifier's target is the tiny random Llama with a 64-token
context window, which bounds the cost of a request asking for 2**32 - 1 tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TINY_VOCAB, make_tiny_llama
from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.engine.model.loading import LoadedModel
from tandem.engine.scheduler.generate import Engine
from tandem.engine.speculation.proposers import DraftModelProposer, NgramProposer
from tandem.services.drafter.core import DrafterCore
from tandem.services.drafter.server import build_server as build_drafter
from tandem.services.drafter.settings import DrafterSettings
from tandem.services.verifier.core import VerifierCore
from tandem.services.verifier.drafter_client import GrpcDrafterConnector
from tandem.services.verifier.server import build_server as build_verifier
from tandem.services.verifier.settings import VerifierSettings
from tandem.serving.grpc_server import build_server as build_grpc_server
from tandem.serving.protoconv import sampling_from_proto
from tandem.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2
from tandem.v1.verifier_pb2_grpc import VerifierStub
from fuzzing import SCALE, fuzz_settings
from test_drafter import wait_for

CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
}
CALL_TIMEOUT_S = 30.0  # far above any legitimate call here: reaching it means a hang
MAX_CONTEXT = 64  # the fuzzed verifier's context window (tokens)
FUZZ = fuzz_settings(60)
PATTERN = list(range(20, 30))
CONTEXT = PATTERN + PATTERN[:3]  # prompt lookup proposes 23 24 ... (as in test_drafter.py)


# -- servers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thread_crashes() -> Iterator[list[str]]:
    """Exceptions that escaped any thread while the module ran (a dead receive or worker thread
    is a bug even when every call's status looks right)."""
    crashes: list[str] = []
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        crashes.append(f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value}")
        previous(args)

    threading.excepthook = hook
    yield crashes
    threading.excepthook = previous


@pytest.fixture(scope="module")
def drafter(tiny_draft_loaded, thread_crashes) -> Iterator[tuple[DrafterCore, str]]:
    """A drafter with the tiny draft model (every strategy), blocks capped at 16 drafts."""
    core = DrafterCore(DrafterSettings(drafter_id="d-fuzz", draft_model=tiny_draft_loaded, max_block_len=16,
                                       max_sessions=64))
    server, port = build_drafter(core)
    server.start()
    yield core, f"127.0.0.1:{port}"
    server.stop(grace=1.0).wait(timeout=5.0)


class ScriptedDrafter(drafter_pb2_grpc.DrafterServicer):
    """A hostile drafter: answers the n-th Open or Commit of a stream with the blocks of
    `script[n]`, each a dict drawn by BLOCK, resolved against what the verifier sent. `truth` is the
    target's own continuation of the context, for blocks that should be accepted."""

    def __init__(self) -> None:
        self.script: list[list[dict]] = []
        self.truth: list[int] = []

    def Draft(self, request_iterator, context):
        script, truth = list(self.script), list(self.truth)
        length = 0  # the session's committed length, as the verifier says
        for request in request_iterator:
            kind = request.WhichOneof("kind")
            if kind == "open":
                length = len(request.open.context_ids)
            elif kind == "commit":
                length = request.commit.committed_len
            else:
                continue
            for spec in script.pop(0) if script else ():
                yield scripted_block(spec, request.session_id, length, truth)

    def GetInfo(self, request, context):
        return drafter_pb2.DrafterInfo(drafter_id="scripted", strategies=[common_pb2.DRAFT_STRATEGY_NGRAM])


def scripted_block(spec: dict, session_id: str, length: int, truth: list[int]) -> drafter_pb2.DraftBlock:
    base = (length + spec["offset"]) % 2**32
    tokens = truth[base : base + len(spec["tokens"])] if spec["truthful"] else spec["tokens"]
    if spec["proposals"] == "one-hot":
        proposals = [drafter_pb2.SparseDistribution(token_ids=[t], probs=[1.0]) for t in tokens]
    elif spec["proposals"] == "spread":
        proposals = [drafter_pb2.SparseDistribution(token_ids=[t, (t + 1) % TINY_VOCAB], probs=[0.75, 0.25])
                     for t in tokens]
    else:
        proposals = spec["proposals"]
    return drafter_pb2.DraftBlock(
        session_id=session_id if spec["session"] is None else spec["session"], base_len=base, token_ids=tokens,
        proposals=proposals, proposer=spec["proposer"], draft_time_us=spec["draft_time_us"],
        speculative=spec["speculative"], confidence=spec["confidence"])


@pytest.fixture(scope="module")
def scripted_drafter(thread_crashes) -> Iterator[tuple[ScriptedDrafter, str]]:
    servicer = ScriptedDrafter()
    server, port, _ = build_grpc_server(lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s),
                                        ["tandem.v1.Drafter"], "127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def target(tiny_tokenizer) -> LoadedModel:
    return LoadedModel(model_id="tiny-64", path="",
                       model=make_tiny_llama(seed=0, num_layers=2, max_positions=MAX_CONTEXT),
                       tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def verifier(target, drafter, scripted_drafter, thread_crashes) -> Iterator[tuple[VerifierCore, VerifierStub]]:
    """A verifier allowed to reach both drafters over gRPC, with room for a few sessions
    (eviction happens)."""
    core = VerifierCore(
        VerifierSettings(verifier_id="v-fuzz", port=0, kv_capacity_tokens=256, max_sessions=4,
                         drafters=(drafter[1], scripted_drafter[1])),
        target, connector=GrpcDrafterConnector(),
    )
    server, port, _ = build_verifier(core)
    server.start()
    core.start(f"127.0.0.1:{port}")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield core, VerifierStub(channel)
    channel.close()
    server.stop(None)
    core.stop()


# -- message strategies -------------------------------------------------------------------------
# Each message is drawn field by field from a plausible value, except for a few fields drawn from
# hostile values: most examples then break one or two things at once, and the rest of the message
# is good enough to get past validation into the code behind it.

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
FLOAT32 = st.one_of(
    st.sampled_from([-1.0, 1.5, 100.0, 1e-30, 3e38, float("nan"), float("inf"), float("-inf"), -0.0]),
    st.floats(width=32),
)
TOKEN = st.one_of(st.integers(-3, TINY_VOCAB + 3), INT32)
# In the vocabulary and shorter than the window; repeating, so that prompt lookup finds matches.
GOOD_TOKENS = st.builds(
    lambda pattern, repeats, tail: (pattern * repeats + tail)[: MAX_CONTEXT - 8],
    st.lists(st.integers(0, TINY_VOCAB - 1), min_size=1, max_size=8), st.integers(1, 8),
    st.lists(st.integers(0, TINY_VOCAB - 1), max_size=6),
)
BAD_TOKENS = st.one_of(
    st.lists(TOKEN, max_size=70),  # ids outside the vocabulary, empty
    st.builds(lambda n: [7] * n, st.integers(MAX_CONTEXT - 2, 5000)),  # at or past the context window
)
# DraftStrategy numbers this build does not know (proto3 enums are open: any int32 parses)
UNKNOWN_STRATEGY = st.one_of(st.integers(5, 100), st.integers(-(2**31), -1), st.integers(5, 2**31 - 1))
TEXT = st.one_of(
    st.text(max_size=40),  # any unicode
    # very long; no lone surrogate: a protobuf string cannot hold one (invalid UTF-8 on the wire is
    # test_verifier_survives_bytes_that_are_no_message's)
    st.builds(lambda c, n: c * n, st.characters(exclude_categories=("Cs",)), st.integers(1000, 100_000)),
)


def mostly_valid(message, valid: dict, hostile: dict):
    """`message(**fields)`: every field from `valid` but up to two from `hostile`."""

    @st.composite
    def build(draw):
        broken = draw(st.sets(st.sampled_from(sorted(hostile)), max_size=2))
        return message(**{k: draw(hostile[k] if k in broken else v) for k, v in valid.items()})

    return build()


SAMPLING = mostly_valid(
    common_pb2.SamplingParams,
    dict(temperature=st.sampled_from([0.0, 0.75, 0.0, 1.0]), top_p=st.sampled_from([0.0, 0.875, 1.0]),
         top_k=st.integers(0, 20), seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
         # 0: the default (128); 1e6: valid, and the context window ends it
         max_new_tokens=st.one_of(st.integers(1, 12), st.sampled_from([0, 1_000_000])),
         stop_token_ids=st.lists(st.integers(0, TINY_VOCAB - 1), max_size=2), ignore_eos=st.booleans()),
    dict(temperature=FLOAT32, top_p=FLOAT32, top_k=INT32, seed=st.integers(2**63, 2**64 - 1),
         max_new_tokens=UINT32, stop_token_ids=st.lists(TOKEN, max_size=4)),
)
SPECULATION = mostly_valid(
    common_pb2.SpeculationParams,
    dict(strategy=st.sampled_from([2, 0, 1, 3, 4]), max_draft_tokens=st.integers(0, 8),
         adaptive=st.one_of(st.none(), st.booleans())),
    dict(strategy=UNKNOWN_STRATEGY, max_draft_tokens=UINT32),
)
MISSING = st.none()  # a submessage left out


def generate_requests(drafter_address: str):
    return mostly_valid(
        verifier_pb2.SessionGenerateRequest,
        dict(session_id=st.one_of(st.sampled_from(["", "s1", "s2", "s3"]), st.text(max_size=8)),
             context_ids=GOOD_TOKENS, sampling=SAMPLING, speculation=SPECULATION,
             drafter_address=st.sampled_from([drafter_address, "", drafter_address]),
             cache_salt=st.sampled_from(["", "", "tenant-a"])),
        dict(session_id=TEXT, context_ids=BAD_TOKENS, sampling=MISSING, speculation=MISSING,
             # not on the allowlist: a closed port, nonsense, other schemes
             drafter_address=st.one_of(st.sampled_from(["127.0.0.1:1", "unix:/tmp/x", "dns:///"]), TEXT),
             cache_salt=TEXT),
    )


# A few ids, so that commits and closes meet open sessions (or ones dropped after an error); rarely
# none at all, which ends the whole stream.
SESSION = st.one_of(st.sampled_from(["a", "b", "a", "c", "b", "a", ""]), st.text(min_size=1, max_size=20))
OPEN = mostly_valid(
    drafter_pb2.OpenSession,
    dict(context_ids=GOOD_TOKENS, strategy=st.sampled_from([2, 3, 4]), max_draft_tokens=st.integers(0, 8),
         sampling=SAMPLING, vocab_size=st.sampled_from([TINY_VOCAB, 300]), next_block_len=st.integers(1, 6)),
    dict(context_ids=BAD_TOKENS, strategy=st.one_of(UNKNOWN_STRATEGY, st.sampled_from([0, 1])), max_draft_tokens=UINT32,
         sampling=MISSING,
         vocab_size=st.one_of(st.sampled_from([0, 1, 10]), UINT32), next_block_len=UINT32),
)
# committed_len None: the driver fills in the consistent value, so commits also reach deep states.
COMMIT = mostly_valid(
    lambda **kw: ("commit", kw),
    dict(committed_len=st.none(), appended_ids=st.lists(st.integers(0, TINY_VOCAB - 1), max_size=6),
         next_block_len=st.integers(1, 6)),
    dict(committed_len=UINT32, appended_ids=st.lists(TOKEN, max_size=10), next_block_len=UINT32),
)
CLOSE = st.builds(drafter_pb2.CloseSession, reason=TEXT)
DRAFT_STREAM = st.lists(
    st.tuples(SESSION, st.one_of(OPEN, OPEN, COMMIT, COMMIT, CLOSE, st.none())),  # None: no oneof set
    min_size=1, max_size=10,
)


FINITE_PROB = st.floats(0.0, 1.0, width=32)
BLOCK = st.fixed_dictionaries(dict(
    session=st.one_of(st.none(), st.none(), st.none(), st.text(max_size=10)),  # None: the session asked about
    offset=st.one_of(st.sampled_from([0, 0, 0, -1, 1, 2]), st.integers(-(2**31), 2**31)),  # base_len - committed
    truthful=st.sampled_from([True, True, False]),  # the target's own tokens (accepted) or `tokens`
    tokens=st.one_of(st.lists(st.integers(0, TINY_VOCAB - 1), max_size=8), st.lists(TOKEN, max_size=8)),
    proposals=st.one_of(
        st.sampled_from([(), (), "one-hot", "spread"]),
        st.lists(st.builds(drafter_pb2.SparseDistribution, token_ids=st.lists(TOKEN, max_size=4),
                           probs=st.lists(st.one_of(FINITE_PROB, FLOAT32), max_size=4)), max_size=8),
    ),
    proposer=st.sampled_from(["ngram", "model", "", "remote", "\u00e9\u0000"]),
    speculative=st.booleans(),
    confidence=st.one_of(st.integers(0, 40), UINT32),
    draft_time_us=st.one_of(st.integers(0, 10_000), st.integers(0, 2**64 - 1)),
))
SCRIPT = st.lists(st.lists(BLOCK, max_size=3), max_size=12)  # the blocks answering each Open / Commit


# -- helpers ------------------------------------------------------------------------------------


def finish(call: grpc.Call, allowed: set = CLIENT_ERRORS) -> tuple[grpc.StatusCode, str, list]:
    """Every response of a streaming call, then its status; DEADLINE_EXCEEDED fails the test, and so
    does any status other than OK and those `allowed` (client errors)."""
    responses = []
    try:
        for msg in call:
            responses.append(msg)
    except grpc.RpcError:
        pass
    code, details = call.code(), call.details() or ""
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"the call hung for {CALL_TIMEOUT_S} s"
    assert code == grpc.StatusCode.OK or code in allowed, f"{code.name}: {details}"
    return code, details, responses


def reference(target: LoadedModel, context: list[int], sampling: SamplingParams) -> list[int]:
    return Engine(target).generate(context, sampling, SpecConfig(strategy=DraftStrategy.none)).token_ids


def check_verifier_serves(stub, target: LoadedModel) -> None:
    context = [5, 17, 42, 99, 17, 42, 7, 250, 17, 42, 99, 3, 11]
    for strategy in (common_pb2.DRAFT_STRATEGY_NONE, common_pb2.DRAFT_STRATEGY_NGRAM):
        request = verifier_pb2.SessionGenerateRequest(
            context_ids=context, sampling=common_pb2.SamplingParams(max_new_tokens=24),
            speculation=common_pb2.SpeculationParams(strategy=strategy))
        code, details, msgs = finish(stub.Generate(request, timeout=CALL_TIMEOUT_S))
        assert code == grpc.StatusCode.OK, details
        assert [t for m in msgs for t in m.token_ids] == reference(target, context, SamplingParams(max_new_tokens=24))


# -- the verifier -------------------------------------------------------------------------------


def test_verifier_survives_fuzzed_generate_requests(verifier, drafter, target, thread_crashes) -> None:
    core, stub = verifier
    _, drafter_address = drafter
    ok = []

    @FUZZ
    @given(request=generate_requests(drafter_address))
    def one(request: verifier_pb2.SessionGenerateRequest) -> None:
        code, details, msgs = finish(stub.Generate(request, timeout=CALL_TIMEOUT_S))
        if code != grpc.StatusCode.OK:
            return
        ok.append(request)
        tokens = []
        for msg in msgs:  # each committed token once, in order, inside the vocabulary
            assert msg.first_index == len(tokens)
            tokens.extend(msg.token_ids)
        assert msgs and msgs[-1].finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        assert all(0 <= t < TINY_VOCAB for t in tokens)
        sampling = sampling_from_proto(request.sampling)
        assert len(tokens) <= sampling.max_new_tokens
        if sampling.greedy:  # whatever the speculation, session reuse or drafter: the target's text
            assert tokens == reference(target, list(request.context_ids), sampling)

    one()
    assert len(ok) >= 5, "the fuzz should reach generation, not only validation"
    assert "INTERNAL" not in drafter[0].stats()["session_errors"]
    check_verifier_serves(stub, target)
    assert wait_for(lambda: core.info()["active_sessions"] == 0)
    assert not thread_crashes


def test_verifier_output_is_the_targets_whatever_a_drafter_sends(verifier, scripted_drafter, drafter, target,
                                                                 thread_crashes) -> None:
    core, stub = verifier
    scripted, address = scripted_drafter
    accepted = []

    @settings(FUZZ, max_examples=40 * SCALE)
    @given(script=SCRIPT, context=GOOD_TOKENS, max_new=st.integers(1, 12), strategy=st.sampled_from([2, 3, 4]),
           temperature=st.sampled_from([0.0, 0.0, 1.0]), seed=st.integers(0, 2**63 - 1))
    def one(script, context, max_new, strategy, temperature, seed) -> None:
        sampling = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=max_new)
        scripted.script = script
        whole = SamplingParams(max_new_tokens=MAX_CONTEXT, ignore_eos=True)  # up to the window
        scripted.truth = context + reference(target, context, whole)
        request = verifier_pb2.SessionGenerateRequest(
            context_ids=context, sampling=common_pb2.SamplingParams(temperature=temperature, seed=seed,
                                                                    max_new_tokens=max_new),
            speculation=common_pb2.SpeculationParams(strategy=strategy, adaptive=False), drafter_address=address)
        code, details, msgs = finish(stub.Generate(request, timeout=CALL_TIMEOUT_S))
        assert code == grpc.StatusCode.OK, details
        tokens = [t for m in msgs for t in m.token_ids]
        accepted.append(msgs[-1].stats.accepted)
        assert all(0 <= t < TINY_VOCAB for t in tokens) and len(tokens) <= max_new
        if sampling.greedy:
            assert tokens == reference(target, context, sampling)

    one()
    assert sum(accepted) > 0, "some scripted drafts should have been accepted"
    check_verifier_serves(stub, target)
    assert not thread_crashes


def test_verifier_refuses_unknown_enum_numbers(verifier, target) -> None:
    _, stub = verifier
    for number in (6, 57, -1, 2**31 - 1):
        request = verifier_pb2.SessionGenerateRequest(
            context_ids=[5, 6, 7], speculation=common_pb2.SpeculationParams(strategy=number))
        code, details, msgs = finish(stub.Generate(request, timeout=CALL_TIMEOUT_S))
        assert (code, msgs) == (grpc.StatusCode.INVALID_ARGUMENT, [])
        assert f"unknown strategy {number}" in details
    # UNSPECIFIED is the server's default, not an error
    request = verifier_pb2.SessionGenerateRequest(
        context_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_new_tokens=3),
        speculation=common_pb2.SpeculationParams(strategy=common_pb2.DRAFT_STRATEGY_UNSPECIFIED))
    code, details, msgs = finish(stub.Generate(request, timeout=CALL_TIMEOUT_S))
    assert code == grpc.StatusCode.OK, details
    assert [t for m in msgs for t in m.token_ids] == reference(target, [5, 6, 7], SamplingParams(max_new_tokens=3))


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("temperature", float("nan"), "temperature = nan"),
    ("temperature", float("inf"), "temperature = inf"),
    ("top_p", float("nan"), "top_p = nan"),
    ("max_new_tokens", 2**32 - 1, "max_new_tokens = 4294967295"),
    ("seed", 2**64 - 1, "seed = 18446744073709551615"),
])
def test_verifier_names_the_bad_sampling_field(verifier, field, value, needle) -> None:
    _, stub = verifier
    request = verifier_pb2.SessionGenerateRequest(context_ids=[5, 6, 7],
                                                  sampling=common_pb2.SamplingParams(**{field: value}))
    code, details, _ = finish(stub.Generate(request, timeout=CALL_TIMEOUT_S))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, details


def test_verifier_survives_bytes_that_are_no_message(verifier, target) -> None:
    """Undecodable bytes are refused by gRPC itself before any servicer runs; the server goes on."""
    core, stub = verifier
    with grpc.insecure_channel(core.address) as raw:
        generate = raw.unary_stream("/tandem.v1.Verifier/Generate", request_serializer=None,
                                    response_deserializer=None)
        for payload in (b"\xff" * 7, b"\x12\x05\x80\x80\x80\x80\x80", b"\x0a\xff\xff\xff\xff\x0f"):
            call = generate(payload, timeout=CALL_TIMEOUT_S)
            with pytest.raises(grpc.RpcError):
                list(call)
            # grpc's own verdict ("Exception deserializing request!"); no servicer code ran
            assert call.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT), call.details()
    check_verifier_serves(stub, target)


def test_verifier_hides_its_own_failures_behind_internal(verifier, monkeypatch, caplog) -> None:
    """A bug inside the verifier is INTERNAL, never UNKNOWN, and its details stay in the log."""
    core, stub = verifier

    def broken(*args, **kwargs):
        raise RuntimeError("/srv/secret/path.py line 7")
        yield

    monkeypatch.setattr(core, "generate", broken)
    call = stub.Generate(verifier_pb2.SessionGenerateRequest(context_ids=[5, 6, 7]), timeout=CALL_TIMEOUT_S)
    with pytest.raises(grpc.RpcError):
        list(call)
    assert call.code() == grpc.StatusCode.INTERNAL and "secret" not in call.details()
    assert "/srv/secret/path.py line 7" in caplog.text


# -- the drafter --------------------------------------------------------------------------------


def test_drafter_survives_fuzzed_draft_streams(drafter, tiny_draft_loaded, thread_crashes) -> None:
    core, address = drafter
    channel = grpc.insecure_channel(address)
    stub = drafter_pb2_grpc.DrafterStub(channel)
    blocks_seen = []

    @FUZZ
    @given(stream=DRAFT_STREAM)
    def one(stream) -> None:
        requests, vocab = [], {}  # vocab: session id -> vocab sizes it was opened with
        length: dict[str, int] = {}  # the driver's idea of each session's committed length
        for sid, kind in stream:
            request = drafter_pb2.DraftRequest(session_id=sid)
            if isinstance(kind, drafter_pb2.OpenSession):
                request.open.CopyFrom(kind)
                vocab.setdefault(sid, set()).add(kind.vocab_size)
                length[sid] = len(kind.context_ids)
            elif isinstance(kind, drafter_pb2.CloseSession):
                request.close.CopyFrom(kind)
            elif kind is not None:
                commit = dict(kind[1])
                if commit["committed_len"] is None:
                    commit["committed_len"] = length.get(sid, 0) + len(commit["appended_ids"])
                commit["committed_len"] %= 2**32
                length[sid] = commit["committed_len"]
                request.commit.CopyFrom(drafter_pb2.Commit(**commit))
            requests.append(request)
        code, details, blocks = finish(stub.Draft(iter(requests), timeout=CALL_TIMEOUT_S))
        if any(not r.session_id for r in requests):  # a message naming no session ends the stream
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "without session_id" in details
        else:
            assert code == grpc.StatusCode.OK, details  # per-session errors drop the session only
        for block in blocks:
            assert block.session_id in vocab, "a block for a session never opened on this stream"
            limit = max(vocab[block.session_id])
            assert all(0 <= t < limit for t in block.token_ids)
            if block.proposals:
                assert len(block.proposals) == len(block.token_ids)
                for tok, q in zip(block.token_ids, block.proposals):
                    assert tok in q.token_ids and all(p > 0 for p in q.probs)
                    assert sum(q.probs) == pytest.approx(1.0, abs=1e-3)
        blocks_seen.extend(blocks)
        assert "INTERNAL" not in core.stats()["session_errors"], core.stats()["session_errors"]

    one()
    channel.close()
    assert len(blocks_seen) >= 10, "the fuzz should reach drafting, not only validation"
    assert wait_for(lambda: core.stats()["active_sessions"] == 0), "sessions of ended streams leaked"
    assert not thread_crashes
    check_drafter_serves(address, tiny_draft_loaded)


def check_drafter_serves(address: str, draft: LoadedModel) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        requests = [
            drafter_pb2.DraftRequest(session_id=sid, open=drafter_pb2.OpenSession(
                context_ids=CONTEXT, strategy=strategy, max_draft_tokens=8, vocab_size=TINY_VOCAB, next_block_len=4))
            for sid, strategy in (("n", common_pb2.DRAFT_STRATEGY_NGRAM), ("m", common_pb2.DRAFT_STRATEGY_MODEL))
        ]
        code, details, blocks = finish(stub.Draft(iter(requests), timeout=CALL_TIMEOUT_S))
        assert code == grpc.StatusCode.OK, details
        regular = {b.session_id: list(b.token_ids) for b in blocks if not b.speculative}
        assert regular["n"] == NgramProposer(1, 4).propose(CONTEXT, 4, SamplingParams(), None).tokens
        direct = DraftModelProposer(draft, vocab_limit=TINY_VOCAB, stop_below=0.0)
        assert regular["m"] == direct.propose(CONTEXT, 4, SamplingParams(), None).tokens


def test_drafter_refuses_unknown_enum_numbers_and_keeps_the_stream(drafter) -> None:
    core, address = drafter
    before = core.stats()["session_errors"].get("INVALID_ARGUMENT", 0)
    with grpc.insecure_channel(address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        requests = [
            drafter_pb2.DraftRequest(session_id=f"u{n}", open=drafter_pb2.OpenSession(
                context_ids=CONTEXT, strategy=n, vocab_size=TINY_VOCAB, next_block_len=4))
            for n in (57, -1, common_pb2.DRAFT_STRATEGY_UNSPECIFIED, common_pb2.DRAFT_STRATEGY_NONE)
        ] + [drafter_pb2.DraftRequest(session_id="ok", open=drafter_pb2.OpenSession(
            context_ids=CONTEXT, strategy=common_pb2.DRAFT_STRATEGY_NGRAM, vocab_size=TINY_VOCAB, next_block_len=4))]
        code, details, blocks = finish(stub.Draft(iter(requests), timeout=CALL_TIMEOUT_S))
    assert code == grpc.StatusCode.OK, details
    assert {b.session_id for b in blocks} == {"ok"}
    assert core.stats()["session_errors"]["INVALID_ARGUMENT"] - before == 4


def test_drafter_names_unknown_strategy_numbers(drafter, caplog) -> None:
    _, address = drafter
    caplog.set_level("WARNING", logger="tandem.drafter")
    with grpc.insecure_channel(address) as channel:
        request = drafter_pb2.DraftRequest(session_id="u", open=drafter_pb2.OpenSession(
            context_ids=CONTEXT, strategy=57, vocab_size=TINY_VOCAB, next_block_len=4))
        finish(drafter_pb2_grpc.DrafterStub(channel).Draft(iter([request]), timeout=CALL_TIMEOUT_S))
    assert "draft session u dropped (INVALID_ARGUMENT): session u: unknown strategy 57" in caplog.text
