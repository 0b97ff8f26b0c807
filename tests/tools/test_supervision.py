"""Availability over real processes: `tandem up`'s stack (Valkey, drafter, two verifiers, gateway,
each its own process, the tiny random Llama as target) under supervision, with faults dealt the
way they happen: SIGKILL, SIGTERM, SIGSTOP (a process that hangs), a Valkey that dies.

Checked: a verifier killed or drained mid-stream hands the stream to the other verifier and the
client's tokens equal an uninterrupted request's; every dead child is started again and serves;
a hung one is killed by the liveness probe and started again;
a restarted Valkey gets the registrations and the residency back; the gateway's own SIGTERM ends a
stream it cannot finish with an SSE error event; an expired deadline frees the verifier; a child
that cannot start any more stops the stack with its reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import grpc
import httpx
import pytest
import redis

from tandem.tools.stack import Stack, StackConfig, free_port
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

PROMPT = "the answer is the answer is the answer is"
LONG = 400  # tokens: the tiny model needs a fraction of a second; a fault lands mid-stream
LIVENESS_S = 8.0  # a child silent this long is killed; the tests' own SIGSTOPs last ~2 s


def _until(what: str, ok, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(tiny_dir):
    os.environ.pop("TANDEM_REDIS_URL", None)
    s = Stack(StackConfig(model=str(tiny_dir), http_port=free_port(), grpc_port=free_port(), verifiers=2,
                          verifier_threads=1, startup_timeout_s=120, log_level="warning", metrics=False,
                          drain_grace_s=0.0, restart_backoff_s=0.2, max_backoff_s=2.0,
                          liveness_timeout_s=LIVENESS_S, liveness_period_s=1.0))
    s.start()
    s.supervise()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def _request(max_new: int = LONG, strategy=common_pb2.DRAFT_STRATEGY_NGRAM, session: str = "") -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        session_id=session, prompt=PROMPT,
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True),
        speculation=common_pb2.SpeculationParams(strategy=strategy))


def _generate(stub, req, on_first=None, timeout: float = 120):
    """(tokens, last message); checks every index arrives once, in order. `on_first(verifier_id)`
    runs when the first message is in."""
    tokens, last = [], None
    for msg in stub.Generate(req, timeout=timeout):
        if not tokens and on_first is not None:
            on_first(msg.verifier_id)
        assert msg.first_index == len(tokens) or not msg.token_ids, "a token lost or sent twice"
        tokens.extend(msg.token_ids)
        last = msg
    return tokens, last


def _pid(stack, name: str) -> int:
    return stack.child(name).proc.pid


def _back(stack, name: str, restarts: int) -> None:
    _until(f"{name} restarted ({restarts})", lambda: stack.child(name).restarts >= restarts
           and stack.child(name).state == "up")


@pytest.fixture(scope="module")
def reference(stub):
    """The uninterrupted output (plain decoding through the same stack), the oracle of every test."""
    tokens, last = _generate(stub, _request(strategy=common_pb2.DRAFT_STRATEGY_NONE))
    assert len(tokens) == LONG and last.resumed == 0
    return tokens


def _whole(stack) -> None:
    """Before a fault: every child up and both verifiers routable at the gateway (its poll and
    Redis caught up with the last restart), so a fault test never starts on a half stack."""
    _until("every child up", lambda: all(c.state == "up" for c in stack.children), 120)

    def routable() -> bool:
        try:
            return httpx.get(f"{stack.http_url}/health", timeout=5).json().get("verifiers") == 2
        except (httpx.HTTPError, ValueError):
            return False

    _until("both verifiers routable at the gateway", routable, 60)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_verifier_that_dies_or_drains_mid_stream_hands_the_stream_over(stack, stub, reference, sig) -> None:
    """SIGKILL: the verifier is gone mid-stream; SIGTERM (drain grace 0): it cuts its stream with
    UNAVAILABLE. Either way the gateway continues the request on the other verifier from the
    tokens already streamed, and the supervisor starts the dead one again."""
    _whole(stack)
    hit = {}

    def fault(vid: str) -> None:
        hit["name"] = vid
        hit["restarts"] = stack.child(vid).restarts
        os.kill(_pid(stack, vid), sig)

    tokens, last = _generate(stub, _request(), on_first=fault)
    assert tokens == reference
    assert last.resumed == 1 and last.verifier_id != hit["name"]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    _back(stack, hit["name"], hit["restarts"] + 1)
    assert any(hit["name"] in e and ("SIGKILL" in e or "code 0" in e) for e in stack.events)
    tokens, _ = _generate(stub, _request(max_new=16))
    assert tokens == reference[:16]


def test_a_hung_verifier_is_killed_and_started_again(stack, stub, reference) -> None:
    """A process that hangs never exits, so watching exits alone would wait on it forever: the
    supervisor's liveness probe sees it silent for LIVENESS_S, kills it and starts it again, and
    requests meanwhile go to the other verifier with the same text."""
    _whole(stack)
    victim = stack.child("verifier-1")
    before, pid = victim.restarts, victim.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        tokens, _ = _generate(stub, _request(max_new=32))
        assert tokens == reference[:32]
        _back(stack, "verifier-1", before + 1)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert any("verifier-1 has not answered its health check" in e for e in stack.events)
    assert any("verifier-1 was killed: no answer to its health check" in e for e in stack.events)
    _whole(stack)
    tokens, last = _generate(stub, _request(max_new=16))
    assert tokens == reference[:16]


def test_a_killed_drafter_is_restarted_and_nothing_changes_meanwhile(stack, stub, reference) -> None:
    _whole(stack)
    before = stack.child("drafter").restarts
    os.kill(_pid(stack, "drafter"), signal.SIGKILL)
    tokens, last = _generate(stub, _request(max_new=64))  # drafter gone: plain steps, same text
    assert tokens == reference[:64]
    _back(stack, "drafter", before + 1)
    tokens, last = _generate(stub, _request(max_new=64))
    assert tokens == reference[:64]


def test_a_restarted_valkey_gets_registrations_and_residency_back(stack, stub) -> None:
    _whole(stack)
    _, last = _generate(stub, _request(max_new=8, session="kept"))
    holder = last.verifier_id
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    _until("the session's residency", lambda: client.hget("tandem:v1:session:kept", "verifier_id") == holder, 10)
    stack.valkey._process.kill()
    _until("valkey restarted", lambda: stack.restarts.get("valkey", 0) >= 1, 30)
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)  # same URL, new server
    _until("both verifiers registered again", lambda: len(client.keys("tandem:v1:verifier:*")) == 2, 30)
    _until("the session's residency published again",
           lambda: client.hget("tandem:v1:session:kept", "verifier_id") == holder, 30)
    _, again = _generate(stub, _request(max_new=8, session="kept"))
    assert again.verifier_id == holder


def test_the_gateways_sigterm_ends_a_stream_it_cannot_finish_with_an_error_event(stack, stub) -> None:
    """The serving verifiers hang (SIGSTOP) mid-stream and the gateway gets SIGTERM (drain grace 0):
    the client's stream ends with an SSE error event, not a silent end; the gateway comes back."""
    _whole(stack)
    verifiers = [c for c in stack.children if c.name.startswith("verifier")]
    before = stack.child("gateway").restarts
    events = []

    def hang_then_terminate() -> None:
        for v in verifiers:
            os.kill(v.proc.pid, signal.SIGSTOP)
        os.kill(_pid(stack, "gateway"), signal.SIGTERM)

    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": LONG, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", f"{stack.http_url}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        hang_then_terminate()
    finally:
        for v in verifiers:
            os.kill(v.proc.pid, signal.SIGCONT)
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["type"] == "service_unavailable_error" and "shutting down" in error["message"]
    _back(stack, "gateway", before + 1)


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_an_expired_deadline_frees_the_verifier(stack, stub, api) -> None:
    """The client's deadline (gRPC's, or X-Request-Timeout) passes while the verifiers hang; the
    request ends with DEADLINE_EXCEEDED / a 504 error event, and once the verifiers run again the
    request is dropped: no active session, no more KV held than before (a one-off keeps nothing)."""
    _whole(stack)
    verifiers = [c for c in stack.children if c.name.startswith("verifier")]
    hung = []

    def info(address: str):
        with grpc.insecure_channel(address) as channel:
            return verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.InfoRequest(), timeout=5)

    baseline = {a: info(a).kv_used_tokens for a in stack.verifier_addresses}

    def hang(*_) -> None:
        for v in verifiers:
            os.kill(v.proc.pid, signal.SIGSTOP)
            hung.append(v)

    try:
        if api == "grpc":
            with pytest.raises(grpc.RpcError) as err:
                _generate(stub, _request(), on_first=hang, timeout=1.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": LONG, "ignore_eos": True,
                    "stream": True, "speculation": {"strategy": "ngram"}}
            events = []
            with httpx.stream("POST", f"{stack.http_url}/v1/chat/completions", json=body, timeout=60,
                              headers={"X-Request-Timeout": "1.5"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 1:
                            hang()
            assert "[DONE]" not in events and json.loads(events[-1])["error"]["type"] == "timeout_error"
    finally:
        for v in hung:
            os.kill(v.proc.pid, signal.SIGCONT)
    for address in stack.verifier_addresses:
        def idle(address=address) -> bool:
            got = info(address)
            return got.active_sessions == 0 and got.kv_used_tokens == baseline[address]

        _until("the verifiers to drop the expired request", idle, 30)

    def drafts() -> int:  # the verifier closed the request's draft session on the drafter too
        from tandem.v1 import drafter_pb2, drafter_pb2_grpc

        with grpc.insecure_channel(stack.drafter_address) as channel:
            return drafter_pb2_grpc.DrafterStub(channel).GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=5).active_sessions

    _until("the drafter to drop the expired request's draft session", lambda: drafts() == 0, 30)


def test_a_child_that_keeps_failing_at_start_stops_the_stack_with_its_reason(tiny_dir, tmp_path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    s = Stack(StackConfig(model=str(model), http_port=free_port(), grpc_port=free_port(), verifier_threads=1,
                          startup_timeout_s=120, log_level="warning", metrics=False, restart_backoff_s=0.1,
                          max_backoff_s=0.5, start_failures=2))
    s.start()
    try:
        s.supervise()
        shutil.rmtree(model)  # from now on the verifier cannot start
        os.kill(_pid(s, "verifier-0"), signal.SIGKILL)
        _until("the supervisor to give up", lambda: s.fatal is not None, 120)
        assert "verifier-0 failed 2 times in a row at start" in s.fatal
        assert str(model) in s.fatal or "its last log lines" in s.fatal
        assert s.child("gateway").proc.poll() is None, "the rest kept running until the stack is stopped"
    finally:
        s.stop()
