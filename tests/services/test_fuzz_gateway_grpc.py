"""Hostile input at the gateway's gRPC edge: hypothesis-generated GenerateRequest and ListModels
calls against a real gateway (grpc.aio and uvicorn in one event loop) over real sockets, open and
with API keys, in front of `FakeVerifier` (test_gateway.py).

A client may send any string as a prompt, role or session id (huge, empty, any unicode, the chat
template's own special tokens), NaN or 2**32 - 1 where a number goes, any int32 as an enum, fields
this build does not know (proto3 keeps them as unknown fields), and any `authorization` metadata.
What every call must do, whatever it is sent:
- end with OK or a client-error status (INVALID_ARGUMENT, UNAUTHENTICATED, RESOURCE_EXHAUSTED, ...),
  never UNKNOWN or INTERNAL (an exception that escaped the servicer), never hang (every call
  carries a deadline, and DEADLINE_EXCEEDED fails the test);
- when it ends OK, stream a well-formed generation: first_index contiguous, the verifier's tokens
  once each in order, the finish reason, usage and stats on the last message only, the text the
  tokens spell;
- leave the gateway as it was: afterwards a normal request is served, /health counts no request in
  flight, no thread died, and every failure the gateway counted is a client error.

The gRPC API takes a prompt only as text (token-id prompts are the HTTP API's, fuzzed by
test_fuzz_http.py): text of vocabulary words, unknown words and special tokens stands in for ids in
and out of the vocabulary. Metadata is drawn from what a gRPC client can send at all (printable
ASCII values, lowercase keys; `-bin` keys carry bytes): the client library refuses anything else
itself. Examples are derandomized and bounded: the same ones every run, in about 10 s on 2 cores.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given
from hypothesis import strategies as st

from tandem.services.gateway.auth import bearer_key
from tandem.v1 import common_pb2, gateway_pb2

from conftest import EOS_ID, SPECIAL_TOKENS, TINY_VOCAB
from fuzzing import fuzz_settings
from test_fuzz_grpc import FLOAT32, INT32, TEXT, TOKEN, UINT32, UNKNOWN_STRATEGY, mostly_valid, wait_for
from test_fuzz_grpc import finish as _finish
from test_fuzz_grpc import thread_crashes  # noqa: F401 (a fixture: exceptions that escaped any thread)
from test_gateway import MODEL, SENTENCE, WINDOW, FakeVerifier, Gateway

CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}
# The gateway's errors (errors.py) that a client's input alone can cause; any other class name in
# GatewayStats.failed is an exception the gateway did not expect.
CLIENT_FAILURES = {"InvalidRequest", "Unauthenticated", "UnknownSession", "SessionConflict", "Overloaded",
                   "PayloadTooLarge"}
CALL_TIMEOUT_S = 30.0  # far above any legitimate call here: reaching it means a hang
FUZZ = fuzz_settings(100, HealthCheck.data_too_large)
KEY = "sk-fuzz-acme-0123456789abcdef"
KEY_SMALL = "sk-fuzz-small-0123456789abcd"  # a tenant with every limit set low
SMALL_MAX_OUTPUT = 6  # its max_output_tokens, below the fake verifier's 7-token script


class TenantCapBypassed(AssertionError):
    """A tenant's max_output_tokens did not bound a completion (found by this fuzz; fixed)."""


# -- servers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verifier(tiny_tokenizer, thread_crashes) -> Iterator[FakeVerifier]:
    v = FakeVerifier("vf", tiny_tokenizer)
    yield v
    v.stop()


@pytest.fixture(scope="module")
def gateways(tiny_tokenizer, verifier, tmp_path_factory) -> Iterator[dict[str, Gateway]]:
    """An open gateway and one with API keys, both in front of the same fake verifier."""
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"tenants": {
        "acme": {"keys": [KEY]},
        "small": {"keys": [KEY_SMALL], "max_input_tokens": 48, "max_output_tokens": SMALL_MAX_OUTPUT,
                  "max_concurrent_requests": 1, "tokens_per_minute": 600},
    }}))
    made = {"open": Gateway(tiny_tokenizer, verifiers=(verifier.address,))}
    try:
        made["keyed"] = Gateway(tiny_tokenizer, verifiers=(verifier.address,), api_keys_file=keys)
        yield made
    finally:
        for gw in made.values():
            gw.close()


# -- message strategies -------------------------------------------------------------------------
# Half the requests are plausible throughout (they reach the verifier: sessions, tenants' limits,
# streaming); the other half are built as in test_fuzz_grpc.py, plausible but for up to two fields
# of each message drawn from hostile values, so that most still get past the first check into the
# code behind it.

WORDS = st.sampled_from(["the", "answer", "is", "4", "2", ".", "w17", "w400", "python", "code", "?"])
OUT_OF_VOCAB = st.sampled_from(["w512", "w99999", "zebra", "éclair", "日本", "\u200b", "\x00", "🙂"])
SPECIAL = st.sampled_from(SPECIAL_TOKENS + ["<|", "|>", "<|weird|>", "{{ messages }}", "{% endfor %}"])
PROMPT_TEXT = st.lists(st.one_of(WORDS, WORDS, OUT_OF_VOCAB, SPECIAL), min_size=1, max_size=30).map(" ".join)
# Tens of thousands of tokens: tokenized off the event loop, then refused for the context window.
# (Past max_body_bytes gRPC itself refuses a message: test_a_message_past_max_body_bytes_...)
HUGE = st.one_of(
    st.builds(lambda n: ". " * n, st.integers(300, 50_000)),
    st.builds(lambda n: "the answer " * n, st.integers(30, 50_000)),
)
ROLE = st.sampled_from(["system", "user", "assistant", "tool", "user", "user"])
ODD_ROLE = st.one_of(st.sampled_from(["", "developer", "USER", " user", "<|user|>", "x" * 300, "\x00"]),
                     st.text(max_size=12))
CHAT_FIELDS = dict(role=ROLE, content=st.one_of(PROMPT_TEXT, st.just("")))
ODD_CHAT_FIELDS = dict(role=ODD_ROLE, content=st.one_of(TEXT, SPECIAL, st.just("")))
VOCAB_TOKEN = st.integers(0, TINY_VOCAB - 1)
SAMPLING_FIELDS = dict(
    temperature=st.sampled_from([0.0, 0.75, 0.0, 1.0]), top_p=st.sampled_from([0.0, 0.875, 1.0]),
    top_k=st.integers(0, 20), seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    # 0: the gateway's default; the fake verifier's script is 7 tokens long
    max_new_tokens=st.one_of(st.integers(1, 12), st.just(0)),
    stop_token_ids=st.lists(st.one_of(VOCAB_TOKEN, st.just(EOS_ID)), max_size=2), ignore_eos=st.booleans(),
)
ODD_SAMPLING_FIELDS = dict(
    temperature=FLOAT32, top_p=FLOAT32, top_k=INT32, seed=st.integers(2**63, 2**64 - 1),
    max_new_tokens=st.one_of(UINT32, st.sampled_from([240, 256, 4096, 4097])),
    stop_token_ids=st.lists(TOKEN, max_size=4),
)
SPECULATION_FIELDS = dict(strategy=st.sampled_from([0, 1, 2, 3, 4]), max_draft_tokens=st.integers(0, 8),
                          adaptive=st.one_of(st.none(), st.booleans()))
ODD_SPECULATION_FIELDS = dict(strategy=UNKNOWN_STRATEGY, max_draft_tokens=st.one_of(UINT32, st.sampled_from([64, 65])))
MISSING = st.none()  # a submessage left out
# Few ids, so that turns meet earlier histories (continue, extend, diverge, fill the window).
SESSION = st.one_of(st.sampled_from(["", "s1", "s2", "", "s1"]), st.text(max_size=8))
ODD_SESSION = st.one_of(TEXT, st.sampled_from(["/", "acme/s1", "../s1", " s1", "s1\x00", "*", "s" * 10_000]))
MODEL_NAME = st.sampled_from(["", MODEL, "default", ""])
ODD_MODEL = st.one_of(st.sampled_from([f"{MODEL} ", MODEL.upper(), f"../{MODEL}", "Default", "\x00"]), TEXT)


def messages(chat_message) -> st.SearchStrategy[gateway_pb2.ChatMessages]:
    return st.builds(lambda items: gateway_pb2.ChatMessages(messages=items),
                     st.one_of(st.lists(chat_message, min_size=1, max_size=5), st.lists(chat_message, max_size=300)))


PLAUSIBLE = dict(
    input=st.one_of(st.tuples(st.just("prompt"), PROMPT_TEXT),
                    st.tuples(st.just("messages"), messages(st.builds(gateway_pb2.ChatMessage, **CHAT_FIELDS)))),
    session_id=SESSION, model=MODEL_NAME,
    sampling=st.one_of(st.builds(common_pb2.SamplingParams, **SAMPLING_FIELDS), MISSING),
    speculation=st.one_of(st.builds(common_pb2.SpeculationParams, **SPECULATION_FIELDS), MISSING),
)
HOSTILE = dict(
    input=st.one_of(
        st.tuples(st.just("prompt"), st.one_of(TEXT, st.just(""), HUGE)),
        st.tuples(st.just("messages"), messages(mostly_valid(gateway_pb2.ChatMessage, CHAT_FIELDS, ODD_CHAT_FIELDS))),
        st.tuples(st.just("none"), st.none()),  # continue the session's history (if there is one)
    ),
    session_id=ODD_SESSION, model=ODD_MODEL,
    sampling=mostly_valid(common_pb2.SamplingParams, SAMPLING_FIELDS, ODD_SAMPLING_FIELDS),
    speculation=mostly_valid(common_pb2.SpeculationParams, SPECULATION_FIELDS, ODD_SPECULATION_FIELDS),
)

# Fields this build does not know, or known numbers with another wire type: (field number, wire
# type, payload). Varint, fixed64, length-delimited, fixed32.
UNKNOWN_FIELD = st.tuples(
    st.one_of(st.integers(1, 20), st.integers(1000, 18_999), st.integers(20_000, 2**29 - 1)),
    st.sampled_from([0, 1, 2, 5]),
    st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=24)),
)
UNKNOWN_FIELDS = st.lists(st.tuples(st.sampled_from(["request", "sampling", "speculation", "message"]),
                                    UNKNOWN_FIELD), max_size=3)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def encode_field(number: int, wire_type: int, payload: int | bytes) -> bytes:
    """One field as protobuf puts it on the wire."""
    value = payload if isinstance(payload, int) else int.from_bytes(payload[:8].ljust(8, b"\0"), "little")
    body = {
        0: lambda: _varint(value),
        1: lambda: value.to_bytes(8, "little"),
        2: lambda: (lambda b: _varint(len(b)) + b)(payload if isinstance(payload, bytes) else _varint(value)),
        5: lambda: (value & 0xFFFFFFFF).to_bytes(4, "little"),
    }[wire_type]()
    return _varint(number << 3 | wire_type) + body


@st.composite
def generate_requests(draw, hostile: bool) -> gateway_pb2.GenerateRequest:
    fields = draw(mostly_valid(dict, PLAUSIBLE, HOSTILE) if hostile else st.fixed_dictionaries(PLAUSIBLE))
    kind, value = fields.pop("input")
    request = gateway_pb2.GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
    if kind == "prompt":
        request.prompt = value
    elif kind == "messages":
        request.messages.CopyFrom(value)
    for where, field in draw(UNKNOWN_FIELDS):
        target = {"request": request, "sampling": request.sampling, "speculation": request.speculation,
                  "message": request.messages.messages[0] if request.messages.messages else request}[where]
        try:
            target.MergeFromString(encode_field(*field))
        except DecodeError:  # e.g. bytes that are no UTF-8 in a known string field: no message to send
            pass  # (test_bytes_that_are_no_message_... sends such bytes raw)
    return request


ASCII = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)
AUTHORIZATION = st.one_of(
    st.sampled_from([f"Bearer {KEY}", f"bearer   {KEY}  ", f"Bearer {KEY_SMALL}", f"Bearer {KEY}",
                     KEY, f"Basic {KEY}", "Bearer", "Bearer ", "", f"Bearer {KEY[:-1]}x", f"Bearer {KEY} {KEY}",
                     f"Bearer sha256:{'0' * 64}", "Bearer " + "k" * 4000]),
    ASCII.map(lambda s: f"Bearer {s}"),
    ASCII,
)
METADATA_ENTRY = st.one_of(
    st.tuples(st.just("authorization"), AUTHORIZATION),
    st.tuples(st.just("authorization"), AUTHORIZATION),
    st.tuples(st.sampled_from(["authorization-bin", "x-api-key-bin"]), st.binary(max_size=40)),
    st.tuples(st.sampled_from(["x-api-key", "tandem-tenant", "x-forwarded-for"]), ASCII),
)
VALID_KEY = st.sampled_from([KEY, KEY, KEY_SMALL]).map(lambda key: (("authorization", f"Bearer {key}"),))
METADATA = st.one_of(VALID_KEY, VALID_KEY, VALID_KEY, st.just(()), st.lists(METADATA_ENTRY, max_size=3).map(tuple))
CALL = st.one_of(
    st.tuples(st.just("generate"), generate_requests(hostile=False), METADATA),
    st.tuples(st.just("generate"), generate_requests(hostile=True), METADATA),
    st.tuples(st.just("generate"), generate_requests(hostile=True), METADATA),
    st.tuples(st.just("list"), st.none(), METADATA),
)
# One to three calls at once on one gateway (the same session meets itself: SessionConflict, the
# small tenant's concurrency limit).
EXAMPLE = st.tuples(st.sampled_from(["open", "keyed"]), st.lists(CALL, min_size=1, max_size=3))


# -- checks -------------------------------------------------------------------------------------


def finish(call) -> tuple[grpc.StatusCode, str, list]:
    return _finish(call, CLIENT_ERRORS)  # the gateway's client errors include UNAUTHENTICATED


def small_tenant(which: str, metadata: tuple) -> bool:
    """Whether the keyed gateway takes this call for the small tenant (exactly one authorization)."""
    auth = [v for k, v in metadata if k == "authorization"]
    return which == "keyed" and len(auth) == 1 and bearer_key(auth[0]) == KEY_SMALL


def check_stream(request: gateway_pb2.GenerateRequest, msgs: list, verifier: FakeVerifier, tokenizer,
                 cap: int | None) -> bool:
    """An OK Generate stream is the fake verifier's script, well formed, and as long as asked
    (max_new_tokens, else what the context window leaves, and never past the tenant's `cap`).
    False when it was longer than `cap` but otherwise right: the tenant limit was bypassed."""
    assert msgs, "an OK stream without a message"
    tokens, text = [], ""
    for i, msg in enumerate(msgs):
        assert msg.first_index == len(tokens), "first_index is not contiguous"
        last = i == len(msgs) - 1
        assert (msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED) == last
        assert msg.HasField("usage") == msg.HasField("stats") == last
        assert msg.verifier_id == verifier.verifier_id
        tokens.extend(msg.token_ids)
        text += msg.text
    usage = msgs[-1].usage
    n = len(tokens)
    assert tokens == verifier.script[:n]
    done = common_pb2.FINISH_REASON_STOP if n == len(verifier.script) else common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].finish_reason == done
    assert usage.completion_tokens == n and usage.prompt_tokens > 0
    assert usage.cached_prompt_tokens <= usage.prompt_tokens
    hidden = set(request.sampling.stop_token_ids) | (set() if request.sampling.ignore_eos else {EOS_ID})
    assert text == tokenizer.decode([t for t in tokens if t not in hidden], skip_special_tokens=True)
    asked = request.sampling.max_new_tokens or WINDOW - usage.prompt_tokens  # 0 = unset
    uncapped = min(len(verifier.script), asked)
    if cap is not None and n == uncapped > cap:
        return False
    assert n == min(uncapped, cap or uncapped), (n, asked, cap)
    return True


def check_gateway_serves(gw: Gateway, metadata: tuple = ()) -> None:
    request = gateway_pb2.GenerateRequest(prompt="the answer", model=MODEL,
                                          sampling=common_pb2.SamplingParams(max_new_tokens=3))
    code, details, msgs = finish(gw.stub.Generate(request, metadata=metadata, timeout=CALL_TIMEOUT_S))
    assert code == grpc.StatusCode.OK, details
    assert "".join(m.text for m in msgs) == " ".join(SENTENCE.split()[:3])
    assert [m.id for m in gw.stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=metadata,
                                             timeout=CALL_TIMEOUT_S).models] == [MODEL]
    assert wait_for(lambda: gw.http.get("/health").json()["requests_in_flight"] == 0)


class _Unary:
    """A unary call's future read like a stream: iterating yields its response (or raises)."""

    def __init__(self, future: grpc.Future):
        self._future = future

    def __iter__(self):
        yield self._future.result()

    def code(self) -> grpc.StatusCode:
        return self._future.code()

    def details(self) -> str:
        return self._future.details()


# -- the fuzz -----------------------------------------------------------------------------------


def test_gateway_survives_fuzzed_grpc_calls(gateways, verifier, tiny_tokenizer, thread_crashes) -> None:
    seen: dict[str, set[str]] = {"open": set(), "keyed": set()}  # status names per gateway
    bypassed: list[gateway_pb2.GenerateRequest] = []
    streams_ok = 0
    pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="fuzz-client")

    def run(gw: Gateway, call) -> tuple[grpc.StatusCode, str, list]:
        op, request, metadata = call
        if op == "list":
            future = gw.stub.ListModels.future(gateway_pb2.ListModelsRequest(), metadata=metadata,
                                               timeout=CALL_TIMEOUT_S)
            return finish(_Unary(future))
        return finish(gw.stub.Generate(request, metadata=metadata, timeout=CALL_TIMEOUT_S))

    @FUZZ
    @given(drawn=EXAMPLE)
    # The small tenant (max_output_tokens 6) asks for no max_tokens; the script is 7 tokens long.
    @example(drawn=("keyed", [("generate", gateway_pb2.GenerateRequest(prompt="the answer"),
                               (("authorization", f"Bearer {KEY_SMALL}"),))]))
    # A session never seen cannot be continued.
    @example(drawn=("open", [("generate", gateway_pb2.GenerateRequest(session_id="never-seen"), ())]))
    def one(drawn) -> None:
        nonlocal streams_ok
        which, calls = drawn
        gw = gateways[which]
        outcomes = list(pool.map(lambda c: run(gw, c), calls))
        for (op, request, metadata), (code, details, msgs) in zip(calls, outcomes):
            seen[which].add(code.name)
            if code == grpc.StatusCode.OK and op == "generate":
                streams_ok += 1
                cap = SMALL_MAX_OUTPUT if small_tenant(which, metadata) else None
                if not check_stream(request, msgs, verifier, tiny_tokenizer, cap):
                    bypassed.append(request)
            if code == grpc.StatusCode.OK and op == "list":
                assert [m.id for m in msgs[0].models] == [MODEL]

    try:
        one()
    finally:
        pool.shutdown()
    # The fuzz reached generation and authentication, not only validation.
    # (Which refusals the keyed gateway shows depends on how many examples got past its key check:
    # the union is what must cover validation.)
    assert {"OK", "INVALID_ARGUMENT", "NOT_FOUND"} <= seen["open"], seen
    assert {"OK", "UNAUTHENTICATED"} <= seen["keyed"], seen
    assert streams_ok >= 20, f"only {streams_ok} Generate calls ended OK"
    check_gateway_serves(gateways["open"])
    check_gateway_serves(gateways["keyed"], (("authorization", f"Bearer {KEY}"),))
    for gw in gateways.values():
        failed = set(gw.core.stats.failed)
        assert failed <= CLIENT_FAILURES, f"the gateway failed requests with {failed - CLIENT_FAILURES}"
    assert not thread_crashes
    if bypassed:
        raise TenantCapBypassed(f"{len(bypassed)} completions of the small tenant ran past its max_output_tokens "
                                f"({SMALL_MAX_OUTPUT}), e.g. for {bypassed[0]}")


def test_a_message_past_max_body_bytes_is_refused_before_the_servicer(gateways) -> None:
    gw = gateways["open"]
    before = gw.core.stats.requests
    request = gateway_pb2.GenerateRequest(prompt="a" * (gw.settings.max_body_bytes + 1))
    code, details, msgs = finish(gw.stub.Generate(request, timeout=CALL_TIMEOUT_S))
    assert (code, msgs) == (grpc.StatusCode.RESOURCE_EXHAUSTED, [])
    assert "larger than max" in details
    assert gw.core.stats.requests == before  # gRPC refused it; GatewayCore never saw it
    check_gateway_serves(gw)


def test_bytes_that_are_no_message_get_invalid_argument_and_the_gateway_goes_on(gateways) -> None:
    """Undecodable bytes (here a prompt that is no UTF-8, which no protobuf client builds, and
    truncated fields) never reach the servicer; a client error, not UNKNOWN, says so."""
    gw = gateways["open"]
    before = gw.core.stats.requests
    generate = gw.channel.unary_stream("/tandem.v1.Gateway/Generate", request_serializer=None,
                                       response_deserializer=None)
    for payload in (encode_field(3, 2, b"\xff\xfe"), b"\xff" * 7, b"\x1a\x05\x80\x80\x80\x80\x80"):
        code, details, msgs = finish(generate(payload, timeout=CALL_TIMEOUT_S))
        assert (code, msgs) == (grpc.StatusCode.INVALID_ARGUMENT, []), details
    assert gw.core.stats.requests == before
    check_gateway_serves(gw)
