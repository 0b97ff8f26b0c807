"""The gateway's front door, attacked over real sockets: API keys (HTTP and gRPC), tenants that own
their sessions, caches that do not leak across tenants (a real verifier on a tiny model and a real
Valkey), bounded and well-formed requests, and errors that give nothing away.

Each test is written as an attacker would work, and asserts what the attacker did not get.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import grpc
import httpx
import openai
import pytest
import redis
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.services.gateway.auth import Keyring, KeyFile, KeyFileError, TenantLimiter, Tenant, bearer_key
from tandem.services.gateway.errors import Overloaded
from tandem.services.gateway.settings import GatewaySettings
from tandem.v1 import common_pb2, gateway_pb2

from test_gateway import MODEL, FakeVerifier, Gateway, chat  # noqa: F401 (fixtures below)
from test_full_chain import RealVerifier

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-0123456789abcdef"
KEY_SLOW = "sk-tenant-slow-0123456789abc"


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"tenants": {
        "acme": {"keys": [KEY_A]},
        "rival": {"keys": ["sha256:" + __import__("hashlib").sha256(KEY_B.encode()).hexdigest()]},
        "small": {"keys": [KEY_SLOW], "max_concurrent_requests": 1, "tokens_per_minute": 60,
                  "max_input_tokens": 64, "max_output_tokens": 8},
    }}))
    return path


@pytest.fixture
def made(tiny_tokenizer):
    things: list = []
    yield things
    for thing in reversed(things):
        thing.close() if isinstance(thing, Gateway) else thing.stop()


def _gateway(made, tiny_tokenizer, **settings) -> Gateway:
    made.append(gw := Gateway(tiny_tokenizer, **settings))
    return gw


def _verifier(made, tiny_tokenizer, vid="va") -> FakeVerifier:
    made.append(v := FakeVerifier(vid, tiny_tokenizer))
    return v


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _chat_body(text="hello", **extra) -> dict:
    return {"model": MODEL, "messages": chat(text), "max_tokens": 4, **extra}


# -- API keys -------------------------------------------------------------------------------------


def test_no_key_or_a_wrong_key_gets_401_on_every_v1_route_and_grpc(made, tiny_tokenizer, keys_file, caplog):
    v = _verifier(made, tiny_tokenizer)
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,), api_keys_file=keys_file)
    caplog.set_level(logging.DEBUG)
    wrong = KEY_A[:-1] + "x"  # one character off: no partial credit
    for headers in ({}, _auth(wrong), {"Authorization": KEY_A}, {"Authorization": "Basic " + KEY_A}):
        for method, path, body in (("POST", "/v1/chat/completions", _chat_body()),
                                   ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
                                   ("GET", "/v1/models", None), ("GET", "/v1/sessions/s", None),
                                   ("DELETE", "/v1/sessions/s", None)):
            r = gw.http.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
    assert v.requests == [], "no unauthenticated request reached a verifier"
    # The official client with a key works; health needs none.
    ok = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY_A, max_retries=0, timeout=10)
    assert ok.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=3).choices[0].message.content
    ok.close()
    with pytest.raises(openai.AuthenticationError):
        gw.openai.models.list()  # api_key="none"
    assert gw.http.get("/health").status_code == 200 and gw.http.get("/healthz").status_code == 200

    req = gateway_pb2.GenerateRequest(prompt="the answer", sampling=common_pb2.SamplingParams(max_new_tokens=2))
    for metadata in ((), (("authorization", f"Bearer {wrong}"),)):
        with pytest.raises(grpc.RpcError) as err:
            list(gw.stub.Generate(req, metadata=metadata, timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            gw.stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    out = list(gw.stub.Generate(req, metadata=(("authorization", f"Bearer {KEY_B}"),), timeout=10))
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # a sha256: entry authenticates
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert KEY_A not in logged and KEY_B not in logged and wrong not in logged


def test_keys_file_rules_and_lookup():
    ring = Keyring(KeyFile.model_validate({"tenants": {"a": {"keys": [KEY_A]}, "b": {"keys": [KEY_B]}}}))
    assert ring.authenticate(KEY_A).name == "a" and ring.authenticate(KEY_B).name == "b"
    assert ring.authenticate(KEY_A + " ") is None and ring.authenticate("") is None
    assert bearer_key("bearer  " + KEY_A) == KEY_A and bearer_key("Bearer ") is None and bearer_key(KEY_A) is None
    for bad in ({"tenants": {"a": {"keys": ["short"]}}},  # guessable
                {"tenants": {"a/b": {"keys": [KEY_A]}}},  # "/" separates tenant and session
                {"tenants": {"a": {"keys": [KEY_A]}, "b": {"keys": [KEY_A]}}},  # one key, two tenants
                {"tenants": {"a": {"keys": ["sha256:xyz"]}}}):
        with pytest.raises((ValueError, KeyFileError)) as err:
            Keyring(KeyFile.model_validate(bad))
        assert KEY_A not in str(err.value) or "tenants" in str(err.value) and KEY_A not in str(err.value)


def test_an_open_gateway_on_a_public_interface_refuses_to_start_unless_told(keys_file):
    with pytest.raises(ValueError, match="without API keys"):
        GatewaySettings(http_host="0.0.0.0")
    with pytest.raises(ValueError, match="without API keys"):
        GatewaySettings(grpc_host="10.1.2.3")
    GatewaySettings(http_host="0.0.0.0", grpc_host="0.0.0.0", allow_unauthenticated=True)
    GatewaySettings(http_host="0.0.0.0", grpc_host="0.0.0.0", api_keys_file=keys_file)
    GatewaySettings(http_host="::1", grpc_host="localhost")  # loopback: open is fine


# -- tenants own their sessions ---------------------------------------------------------------


def test_a_second_tenant_cannot_read_continue_or_delete_a_first_tenants_session(made, tiny_tokenizer, keys_file):
    v = _verifier(made, tiny_tokenizer)
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,), api_keys_file=keys_file)
    secret = "my secret is swordfish"
    r = gw.http.post("/v1/chat/completions", json=_chat_body(secret), headers={**_auth(KEY_A), "X-Session-Id": "conv"})
    assert r.status_code == 200
    owner_tokens = gw.http.get("/v1/sessions/conv", headers=_auth(KEY_A)).json()["tokens"]
    assert owner_tokens > 0

    # The rival reads, continues, deletes: each answers exactly as for a session that never existed.
    never = gw.http.get("/v1/sessions/zzzz", headers=_auth(KEY_B))
    read = gw.http.get("/v1/sessions/conv", headers=_auth(KEY_B))
    assert read.status_code == never.status_code == 404
    assert read.json()["error"]["message"].replace("conv", "X") == never.json()["error"]["message"].replace("zzzz", "X")
    cont = gateway_pb2.GenerateRequest(session_id="conv", sampling=common_pb2.SamplingParams(max_new_tokens=2))
    with pytest.raises(grpc.RpcError) as err:  # no input: continue the session from its history
        list(gw.stub.Generate(cont, metadata=(("authorization", f"Bearer {KEY_B}"),), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert gw.http.delete("/v1/sessions/conv", headers=_auth(KEY_B)).status_code == 404

    # The same id used by the rival is the rival's own, separate session: its verifier request
    # carries none of the first tenant's history, under another session id and cache salt.
    first = v.requests[-1]
    r = gw.http.post("/v1/chat/completions", json=_chat_body("hello"), headers={**_auth(KEY_B), "X-Session-Id": "conv"})
    assert r.status_code == 200 and r.json()["tandem"]["session_id"] == "conv"
    second = v.requests[-1]
    assert second.session_id != first.session_id and second.cache_salt != first.cache_salt
    assert (first.session_id, first.cache_salt) == ("acme/conv", "acme")
    secret_ids = tiny_tokenizer(secret, add_special_tokens=False)["input_ids"]
    assert not any(list(second.context_ids[i:i + len(secret_ids)]) == secret_ids for i in range(len(second.context_ids)))

    # The owner's session is untouched by all of it.
    assert gw.http.get("/v1/sessions/conv", headers=_auth(KEY_A)).json()["tokens"] == owner_tokens
    assert gw.http.delete("/v1/sessions/conv", headers=_auth(KEY_A)).json()["deleted"] is True


def test_two_concurrent_requests_on_one_session_get_409(made, tiny_tokenizer):
    v = _verifier(made, tiny_tokenizer)
    v.step_delay_s = 0.3
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,))
    results: list = []
    t = threading.Thread(target=lambda: results.append(
        gw.http.post("/v1/chat/completions", json=_chat_body(max_tokens=8), headers={"X-Session-Id": "s"})))
    t.start()
    while not v.requests:  # the first turn reached the verifier: it is in flight
        time.sleep(0.01)
    second = gw.http.post("/v1/chat/completions", json=_chat_body(max_tokens=8), headers={"X-Session-Id": "s"})
    assert second.status_code == 409 and "in flight" in second.json()["error"]["message"]
    req = gateway_pb2.GenerateRequest(session_id="s", prompt="x", sampling=common_pb2.SamplingParams(max_new_tokens=2))
    with pytest.raises(grpc.RpcError) as err:
        list(gw.stub.Generate(req, timeout=10))
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert gw.http.delete("/v1/sessions/s").status_code == 409  # not while a turn runs
    t.join(10)
    assert results[0].status_code == 200
    assert len(v.requests) == 1, "the refused requests never reached a verifier"
    assert gw.http.post("/v1/chat/completions", json=_chat_body(), headers={"X-Session-Id": "s"}).status_code == 200


# -- caches do not leak across tenants --------------------------------------------------------


def test_prefix_cache_probe_learns_nothing_across_tenants(made, tiny_loaded, redis_url, keys_file):
    """A rival probes whether acme's prompt held a phrase: the right and the wrong guess get the
    same cached_tokens (none), while acme itself still shares its prefixes (so the probe works)."""
    redis.Redis.from_url(redis_url).flushdb()
    v = RealVerifier("v0", tiny_loaded, redis_url)
    made.append(v)
    gw = _gateway(made, tiny_loaded.tokenizer, model=MODEL, verifiers=(v.address,), redis_url=redis_url,
                  api_keys_file=keys_file)
    words = "you are a tool that can call a function and write code the answer is".split()
    secret = " ".join(words * 6)  # ~90 tokens: several 32-token blocks
    wrong = " ".join(list(reversed(words)) * 6)

    def cached(key: str, prompt: str, session: str | None = None) -> int:
        headers = {**_auth(key), **({"X-Session-Id": session} if session else {})}
        r = gw.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(KEY_A, secret + " done", session="victim")  # resident now, and published to Redis
    right_guess = cached(KEY_B, secret + " probe")
    wrong_guess = cached(KEY_B, wrong + " probe")
    assert right_guess == wrong_guess == 0
    assert cached(KEY_A, secret + " again") >= 64, "within a tenant, shared prefixes are still reused"
    # Redis: the rival's prefix lookup finds nothing of acme's blocks; acme's finds its verifier.
    index = gw.core._index
    ids = tiny_loaded.tokenizer(secret, add_special_tokens=False)["input_ids"]
    assert index.longest_prefix(ids, salt="rival") == {}
    assert index.longest_prefix(ids, salt="acme") != {}


# -- bounded, well-formed requests ----------------------------------------------------------


def test_bodies_must_be_json_and_bounded(made, tiny_tokenizer):
    v = _verifier(made, tiny_tokenizer)
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,), max_body_bytes=64 * 1024)
    r = gw.http.post("/v1/chat/completions", content=json.dumps(_chat_body()), headers={"Content-Type": "text/plain"})
    assert r.status_code == 415  # a web page's no-preflight POST
    r = gw.http.post("/v1/chat/completions", data={"model": MODEL})
    assert r.status_code == 415
    big = _chat_body("word " * 20_000)
    r = gw.http.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: refused while streaming in
        for _ in range(100):
            yield b" " * 4096

    r = gw.http.post("/v1/chat/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    # Hostile JSON: 400, never 500.
    for raw in ("[" * 50_000, '{"messages": ' + "[" * 40 + "]" * 40 + "}", '{"a": 1', "\xff\xfe"):
        r = gw.http.post("/v1/chat/completions", content=raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw,
                         headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (raw[:20], r.status_code)
    # Errors quote a short cut of the input, never all of it.
    r = gw.http.post("/v1/chat/completions", json=_chat_body(model="m" * 5000))
    assert r.status_code == 400 and len(r.json()["error"]["message"]) < 400
    r = gw.http.post("/v1/chat/completions", json={**_chat_body(), "temperature": "x" * 5000})
    assert r.status_code == 400 and len(r.json()["error"]["message"]) < 400
    assert v.requests == []
    assert gw.http.post("/v1/chat/completions", json=_chat_body()).status_code == 200


def test_a_maximal_body_never_delays_health(made, tiny_tokenizer):
    """A body just under the limit is read and tokenized off the event loop: /health answers while
    it is in flight (shown by order of events, not by a time threshold)."""
    v = _verifier(made, tiny_tokenizer)
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,))
    limit = gw.settings.max_body_bytes
    text = "the answer is 4 2 . " * ((limit - 1000) // 20)
    body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 2}).encode()
    assert len(body) <= limit
    events: list[tuple[str, float]] = []

    def big():
        with httpx.Client(base_url=gw.url, timeout=60) as c:
            events.append(("big sent", time.monotonic()))
            r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            events.append((f"big {r.status_code}", time.monotonic()))

    t = threading.Thread(target=big)
    t.start()
    answered_during = 0
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        while t.is_alive():
            r = c.get("/health")
            assert r.status_code == 200
            if t.is_alive() and events and events[0][0] == "big sent":
                answered_during += 1
    t.join()
    assert events[-1][0] == "big 400"  # longer than the context window: refused after tokenizing
    assert answered_during >= 2, "health must answer while the big request is being tokenized"


def test_tenant_limits_and_retry_after(made, tiny_tokenizer, keys_file):
    v = _verifier(made, tiny_tokenizer)
    v.step_delay_s = 0.2
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,), api_keys_file=keys_file)
    small = _auth(KEY_SLOW)
    r = gw.http.post("/v1/completions", json={"prompt": "the answer " * 60, "max_tokens": 2}, headers=small)
    assert r.status_code == 400 and "limit of 64 input tokens" in r.json()["error"]["message"]
    r = gw.http.post("/v1/completions", json={"prompt": "the answer", "max_tokens": 9}, headers=small)
    assert r.status_code == 400 and "limit of 8" in r.json()["error"]["message"]

    # One request at a time for this tenant; other tenants unaffected.
    results: list = []
    t = threading.Thread(target=lambda: results.append(
        gw.http.post("/v1/completions", json={"prompt": "the answer", "max_tokens": 6}, headers=small)))
    t.start()
    while not v.requests:
        time.sleep(0.01)
    r = gw.http.post("/v1/completions", json={"prompt": "the answer", "max_tokens": 2}, headers=small)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert gw.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=_auth(KEY_A)).status_code == 200
    t.join(10)
    assert results[0].status_code == 200

    # 60 tokens a minute: spend them, then 429 with a Retry-After that says how long.
    spent = 0
    while True:
        r = gw.http.post("/v1/completions", json={"prompt": "the answer is " * 5, "max_tokens": 8}, headers=small)
        if r.status_code == 429:
            break
        assert r.status_code == 200
        spent += r.json()["usage"]["total_tokens"]
        assert spent < 200, "the token rate limit never applied"
    assert int(r.headers["retry-after"]) >= 1 and "tokens per minute" in r.json()["error"]["message"]


def test_token_bucket_refills_continuously():
    lim = TenantLimiter()
    t = Tenant("x", tokens_per_minute=600)  # 10 a second
    lim.admit(t, 590)
    lim.release(t, 20)  # the completion overdraws the bucket by 10
    with pytest.raises(Overloaded) as err:
        lim.admit(t, 1)
    assert 1.0 < err.value.retry_after_s <= 1.2  # back above zero after 11 tokens' refill
    lim._buckets["x"].stamp -= 1.2  # that long passes
    lim.admit(t, 1)


# -- what the gateway gives away ------------------------------------------------------------


def test_errors_never_name_internal_addresses(made, tiny_tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    live = _verifier(made, tiny_tokenizer)
    live.kv_full = True
    gw = _gateway(made, tiny_tokenizer, verifiers=(dead, live.address))
    gw.core._static[dead] = gw.core._static[live.address].__class__(
        "vdead", dead, MODEL, 256, 100_000, 0, 0)  # as if it had answered a poll, then died
    r = gw.http.post("/v1/chat/completions", json=_chat_body())
    assert r.status_code in (429, 503)
    message = r.json()["error"]["message"]
    assert "127.0.0.1" not in message and dead.split(":")[1] not in message and live.address not in message


def test_grpc_unknown_enum_reflection_off_and_metrics_port(made, tiny_tokenizer):
    v = _verifier(made, tiny_tokenizer)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,), metrics_port=metrics_port)
    req = gateway_pb2.GenerateRequest(prompt="x", speculation=common_pb2.SpeculationParams(strategy=57))
    with pytest.raises(grpc.RpcError) as err:
        list(gw.stub.Generate(req, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "57" in err.value.details()
    refl = reflection_pb2_grpc.ServerReflectionStub(gw.channel)
    with pytest.raises(grpc.RpcError) as err:
        list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert gw.http.get("/metrics").status_code == 404  # only on its own port
    assert httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").status_code == 200

    gw2 = _gateway(made, tiny_tokenizer, verifiers=(v.address,), grpc_reflection=True)
    answers = list(reflection_pb2_grpc.ServerReflectionStub(gw2.channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    assert "tandem.v1.Gateway" in {s.name for s in answers[0].list_services_response.service}


def test_api_keys_rotate_without_a_restart(made, tiny_tokenizer, keys_file, caplog):
    v = _verifier(made, tiny_tokenizer)
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,), api_keys_file=keys_file)
    new_key = "sk-rotated-key-0123456789abcd"
    assert gw.http.get("/v1/models", headers=_auth(KEY_A)).status_code == 200
    keys_file.write_text(json.dumps({"tenants": {"acme": {"keys": [new_key]}}}))  # the old key removed
    gw.core.keys._checked -= 10  # as if the check interval had passed
    assert gw.http.get("/v1/models", headers=_auth(KEY_A)).status_code == 401
    assert gw.http.get("/v1/models", headers=_auth(new_key)).status_code == 200
    keys_file.write_text("{not json")  # a broken edit keeps the keys in force
    gw.core.keys._checked -= 10
    assert gw.http.get("/v1/models", headers=_auth(new_key)).status_code == 200
    assert any("previous keys stay in force" in r.getMessage() for r in caplog.records)


def test_a_rival_tenant_drafts_nothing_from_anothers_answers(made, tiny_loaded, redis_url, keys_file):
    """Suffix decoding's cross-session store through the whole chain (gateway with API keys, a real
    verifier, a real drafter): acme's finished answer speeds up acme's next identical request, and
    the rival asking the same gets none of it (its drafts come only from its own tokens), with
    every output the same text. The drafter keeps one store per tenant scope."""
    from tandem.services.drafter.core import DrafterCore
    from tandem.services.drafter.server import build_server as build_drafter
    from tandem.services.drafter.settings import DrafterSettings

    redis.Redis.from_url(redis_url).flushdb()
    dcore = DrafterCore(DrafterSettings(drafter_id="d-tenants"))
    dserver, dport = build_drafter(dcore, "127.0.0.1:0")
    dserver.start()
    drafter = f"127.0.0.1:{dport}"
    try:
        v = RealVerifier("v0", tiny_loaded, redis_url, drafters=(drafter,))
        made.append(v)
        gw = _gateway(made, tiny_loaded.tokenizer, model=MODEL, verifiers=(v.address,), drafters=(drafter,),
                      redis_url=redis_url, api_keys_file=keys_file)
        prompt = "write the answer of the tool call and the code for it"

        def ask(key: str) -> dict:
            r = gw.http.post("/v1/chat/completions", headers=_auth(key), json={
                "model": MODEL, "messages": chat(prompt), "max_tokens": 24, "temperature": 0,
                "speculation": {"strategy": "suffix", "adaptive": False, "max_draft_tokens": 8}})
            assert r.status_code == 200, r.text
            return r.json()

        def settled(n: int) -> None:  # the finished answer reaches the drafter's store (its Close)
            deadline = time.monotonic() + 10
            while dcore.stats()["suffix"]["responses"] < n and time.monotonic() < deadline:
                time.sleep(0.02)

        cold = ask(KEY_A)
        settled(1)
        warm = ask(KEY_A)
        settled(2)
        rival = ask(KEY_B)
        settled(3)
        texts = {r["choices"][0]["message"]["content"] for r in (cold, warm, rival)}
        assert len(texts) == 1, "speculation never changes the text"
        spec = {name: r["usage"]["speculation"] for name, r in (("cold", cold), ("warm", warm), ("rival", rival))}
        assert spec["warm"]["accepted"] >= spec["cold"]["accepted"] + 8, spec  # acme's answer drafted acme's
        assert spec["rival"]["accepted"] <= spec["cold"]["accepted"], spec  # the rival got nothing of it
        assert spec["rival"]["steps"] >= spec["cold"]["steps"], spec
        assert dcore.stats()["suffix"]["stores"] == 2, "one store per tenant scope"
    finally:
        dserver.stop(None)


# -- bounded errors ---------------------------------------------------------------------------------

MAX_ERROR_BODY = 2048  # bytes: errors.MAX_MESSAGE_CHARS of message and the JSON around it


@pytest.mark.parametrize("name, body", [
    ("100,000 stop ids outside the vocabulary", {"stop_token_ids": list(range(10**6, 10**6 + 100_000))}),
    ("100,000 logit_bias entries", {"logit_bias": {str(10**6 + i): 1 for i in range(100_000)}}),
    ("a 1 MB unknown field name", {"x" * 1_000_000: 1}),
    ("a 1 MB stop string", {"stop": ["s" * 1_000_000]}),
    ("20,000 wrong-typed stop strings", {"stop": [1] * 20_000}),
    ("a 1 MB model name", {"model": "m" * 1_000_000}),
    ("a 1 MB tool_choice naming no tool", {
        "tools": [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "n" * 1_000_000}}}),
    ("a 1 MB response_format", {"response_format": {"type": "t" * 1_000_000}}),
])
def test_every_error_body_is_bounded(made, tiny_tokenizer, name, body):
    """Oversized values of every kind get a 4xx whose body stays under a fixed size and never
    repeats the input (a 356 KB error body once quoted 100,000 stop ids back)."""
    v = _verifier(made, tiny_tokenizer)
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,), max_body_bytes=8 * 1024 * 1024)
    r = gw.http.post("/v1/chat/completions", json={**_chat_body(), **body})
    assert 400 <= r.status_code < 500, (name, r.status_code)
    assert len(r.content) < MAX_ERROR_BODY, (name, len(r.content))
    assert r.json()["error"]["message"], name
    assert not v.requests, "nothing reached a verifier"


def test_a_lone_surrogate_is_named_not_a_codec_exception(made, tiny_tokenizer):
    v = _verifier(made, tiny_tokenizer)
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,))
    raw = '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud800 there"}]}' % MODEL
    r = gw.http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "surrogate" in message and "U+D800" in message and "codec" not in message and "utf-8" not in message
    raw = '{"model": "%s", "max_tokens": 2, "prompt": "\\udfff"}' % MODEL
    r = gw.http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "prompt holds a lone surrogate" in r.json()["error"]["message"]


def test_one_request_larger_than_a_minutes_allowance_is_refused_not_admitted(made, tiny_tokenizer, keys_file):
    """The 'small' tenant may use 60 tokens a minute: a request that may use more on its own is a
    400 that says why, and the tenant's bucket is untouched (the next small request is served)."""
    v = _verifier(made, tiny_tokenizer)
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,), api_keys_file=keys_file)
    small = _auth(KEY_SLOW)
    r = gw.http.post("/v1/completions", json={"prompt": "the answer is " * 19, "max_tokens": 8}, headers=small)
    assert r.status_code == 400 and "more than this API key's tenant may use in a minute (60)" in r.json()["error"]["message"]
    assert not v.requests
    assert gw.http.post("/v1/completions", json={"prompt": "the answer", "max_tokens": 2}, headers=small).status_code == 200


def test_a_key_file_readable_by_others_is_warned_about(keys_file, caplog):
    keys_file.chmod(0o644)
    caplog.set_level(logging.WARNING, logger="tandem.security")
    Keyring.load(keys_file)
    assert any("readable by group or others" in r.getMessage() and "chmod 600" in r.getMessage() for r in caplog.records)
    caplog.clear()
    other = keys_file.with_name("private.json")
    other.write_text(keys_file.read_text())
    other.chmod(0o600)
    Keyring.load(other)
    assert not any("readable by group or others" in r.getMessage() for r in caplog.records)


# -- admission before work --------------------------------------------------------------------------

MAXIMAL = json.dumps({"prompt": "ab " * 1_300_000, "max_tokens": 1}).encode()  # 3.9 MB


def _start_slow_post(port: int, key: str, body: bytes, sent: int = 1024) -> socket.socket:
    """A POST whose body is still on its way: headers and the first `sent` bytes only."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:sent])
    return s


def _finish(s: socket.socket, body: bytes, sent: int = 1024) -> int:
    s.sendall(body[sent:])
    s.settimeout(60)
    head = s.recv(65536).decode("latin-1")
    s.close()
    return int(head.split(" ", 2)[1])


def test_a_two_slot_tenant_sending_six_maximal_bodies_gets_four_429s_at_once_and_slows_nobody(made, tiny_tokenizer, tmp_path):
    """The slot is taken at intake, before the body is read: with two of its maximal bodies still
    streaming in, the tenant's next four are refused at once (429) without their bodies being read
    or tokenized, another tenant's chat is served meanwhile (it ends before the two do: event
    order, not a stopwatch), and the tenant's slots come back when the two end."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": {"pair": {"keys": [KEY_A], "max_concurrent_requests": 2},
                                            "other": {"keys": [KEY_B]}}}))
    keys.chmod(0o600)
    v = _verifier(made, tiny_tokenizer)
    gw = _gateway(made, tiny_tokenizer, verifiers=(v.address,), api_keys_file=keys, max_body_bytes=8 * 1024 * 1024)
    port = int(gw.url.rsplit(":", 1)[1])
    tokenized: list[int] = []
    original = gw.core._context_ids
    gw.core._context_ids = lambda req: tokenized.append(1) or original(req)

    slow = [_start_slow_post(port, KEY_A, MAXIMAL) for _ in range(2)]
    deadline = time.monotonic() + 30
    while gw.core.limiter._active.get("pair", 0) < 2:
        assert time.monotonic() < deadline, "the two slow requests never took their slots"
        time.sleep(0.01)
    refused = [gw.http.post("/v1/completions", content=MAXIMAL, headers={**_auth(KEY_A), "content-type": "application/json"})
               for _ in range(4)]
    assert [r.status_code for r in refused] == [429] * 4
    assert all("2 requests in flight" in r.json()["error"]["message"] for r in refused)
    assert tokenized == [], "a refused body was tokenized"

    other = gw.http.post("/v1/chat/completions", json=_chat_body(), headers=_auth(KEY_B))
    assert other.status_code == 200 and other.json()["choices"][0]["message"]["content"]
    assert gw.core.limiter._active.get("pair") == 2, "the other tenant was served while both slow ones were still open"

    assert [_finish(s, MAXIMAL) for s in slow] == [400, 400]  # too long for the context window
    assert gw.core.limiter._active.get("pair") is None
    assert gw.http.post("/v1/completions", json={"prompt": "the answer", "max_tokens": 2},
                        headers=_auth(KEY_A)).status_code == 200


def test_a_text_that_cannot_fit_is_refused_before_tokenization(made):
    """With a BPE tokenizer (the embedded SmolLM2's) a text of B bytes is at least B / (longest
    entry) tokens: a 3.9 MB prompt is refused at once, never tokenized, and said why."""
    from tandem.engine.model.tokenizer import load_tokenizer

    _, tok, _ = load_tokenizer("default", progress=False)
    v = _verifier(made, tok)
    gw = _gateway(made, tok, verifiers=(v.address,), max_body_bytes=8 * 1024 * 1024)
    tokenized: list[int] = []
    original = gw.core._context_ids
    gw.core._context_ids = lambda req: tokenized.append(1) or original(req)
    r = gw.http.post("/v1/completions", content=MAXIMAL, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "so at least" in r.json()["error"]["message"]
    assert tokenized == []
    assert gw.http.post("/v1/completions", json={"prompt": "the answer", "max_tokens": 2}).status_code == 200
    assert tokenized == [1]
