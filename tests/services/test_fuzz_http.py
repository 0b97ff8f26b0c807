"""Property-based fuzzing of the gateway's HTTP API against a running gateway (real uvicorn, real
sockets, a gRPC verifier behind it): hypothesis generates request bodies shaped like the OpenAI
requests (right and wrong types, unknown fields, extreme numbers, odd unicode, deep nesting) plus
raw bytes and odd headers. Every answer must be a 2xx or a 4xx in the OpenAI error shape, never a
5xx and never a hang; afterwards the gateway serves a normal request normally.

Examples are derandomized and bounded, so the run is reproducible and takes seconds.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from fuzzing import fuzz_settings
from test_gateway import MODEL, FakeVerifier, Gateway, chat

FUZZ = fuzz_settings(150, HealthCheck.function_scoped_fixture)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)
roles = st.sampled_from(["user", "system", "assistant", "tool", "", "developer", "x" * 300])
message = st.fixed_dictionaries(
    {"role": roles | json_values},
    optional={"content": st.text(max_size=60) | json_values
              | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)})),
              "name": st.text(max_size=10), "tool_calls": json_values},
)
common = {
    "model": st.sampled_from([MODEL, "default", "", "other"]) | json_values,
    "max_tokens": st.integers(min_value=-5, max_value=10**12) | json_values,
    "max_completion_tokens": st.integers(min_value=-5, max_value=40),
    "temperature": st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0, 0.7, 2.5, -1]),
    "top_p": st.floats(allow_nan=True) | st.sampled_from([0, 0.5, 1, 1.5]),
    "top_k": st.integers(min_value=-3, max_value=10**9),
    "seed": st.integers(min_value=-(2**70), max_value=2**70),
    "n": st.integers(min_value=-1, max_value=3),
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | json_values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3),
    "stop_token_ids": st.lists(st.integers(min_value=-10, max_value=2**40), max_size=5),
    "ignore_eos": st.booleans(),
    "session_id": st.text(max_size=300) | json_values,
    "speculation": st.fixed_dictionaries({}, optional={
        "strategy": st.sampled_from(["none", "ngram", "suffix", "model", "hybrid", "bogus"]),
        "max_draft_tokens": st.integers(min_value=-2, max_value=200),
        "adaptive": st.booleans() | json_values,
    }) | json_values,
    "presence_penalty": st.floats(allow_nan=True),
    "logprobs": st.booleans() | st.integers(-1, 5),
    "unknown_field": json_values,
}
chat_bodies = st.fixed_dictionaries({"messages": st.lists(message, max_size=4) | json_values}, optional=common)
completion_bodies = st.fixed_dictionaries(
    {"prompt": st.text(max_size=80) | st.lists(st.integers(min_value=-5, max_value=600), max_size=12)
     | st.lists(st.text(max_size=10), max_size=3) | json_values},
    optional=common,
)


@pytest.fixture(scope="module")
def gateway(tiny_tokenizer):
    verifier = FakeVerifier("vf", tiny_tokenizer)
    gw = Gateway(tiny_tokenizer, verifiers=(verifier.address,), max_body_bytes=64 * 1024)
    yield gw, verifier
    gw.close()
    verifier.stop()


STATUSES: dict[int, int] = {}  # status -> answers, over the fuzz tests of this module


def _check(r: httpx.Response) -> None:
    STATUSES[r.status_code] = STATUSES.get(r.status_code, 0) + 1
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]  # OpenAI's error shape, always
        assert isinstance(err["message"], str) and err["code"] == r.status_code
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events, "a stream carries events"
        assert events[-1] == "data: [DONE]" or "error" in json.loads(events[-1][6:])


def _post(gw, path: str, body) -> httpx.Response:
    return gw.http.post(path, content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"},
                        timeout=20)


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat_completions(gateway, body):
    gw, _ = gateway
    _check(_post(gw, "/v1/chat/completions", body))


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(gateway, body):
    gw, _ = gateway
    _check(_post(gw, "/v1/completions", body))


@fuzz_settings(80, HealthCheck.function_scoped_fixture)
@given(raw=st.binary(max_size=200), ctype=st.sampled_from(["application/json", "application/json; charset=latin-1",
                                                            "text/plain", "", "application/x-www-form-urlencoded"]),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/sessions/%00", "/v1/models"]),
       method=st.sampled_from(["POST", "GET", "DELETE", "PUT"]),
       session=st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20))
def test_fuzz_raw_requests(gateway, raw, ctype, path, method, session):
    gw, _ = gateway
    headers = {"Content-Type": ctype} if ctype else {}
    if session and session == session.strip():  # what a header can carry (h11 refuses the rest client-side)
        headers["X-Session-Id"] = session
    r = gw.http.request(method, path, content=raw, headers=headers, timeout=20)
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert "error" in r.json()


def test_after_the_fuzz_the_gateway_serves_normally(gateway, tiny_tokenizer):
    gw, verifier = gateway
    reply = gw.openai.chat.completions.create(model=MODEL, messages=chat("hello"), max_tokens=20)
    assert reply.choices[0].message.content == tiny_tokenizer.decode(verifier.script, skip_special_tokens=True)
    health = gw.http.get("/health").json()
    assert health["status"] == "ok" and health["requests_in_flight"] == 0
    if STATUSES:  # the fuzz ran in this session: it must have reached generation, not only refusals
        assert STATUSES.get(200, 0) >= 5 and STATUSES.get(400, 0) >= 5, STATUSES
