"""The gateway end to end over real sockets: uvicorn serving the OpenAI API (driven by httpx and the
official `openai` client), the grpc.aio Gateway service, a real Valkey for residency.

Only the verifier's generation logic is stood in for: `FakeVerifier` is a real gRPC Verifier
servicer that commits a fixed sentence of the tiny tokenizer two tokens per step (then EOS), and
publishes its residency with a real ResidencyPublisher as a verifier does. The tests check what the
gateway owns: validation, routing, text assembly, error mapping, cancellation.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import httpx
import openai
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.gateway.client import RpcClients
from tandem.services.gateway.core import GatewayCore
from tandem.services.gateway.serve import run_gateway
from tandem.services.gateway.settings import GatewaySettings
from tandem.serving.residency import ResidencyConfig, ResidencyPublisher, VerifierRecord
from tandem.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from conftest import EOS_ID

MODEL = "tiny"
WINDOW = 256  # the fake verifiers' max_context_tokens (the tokenizer's model allows 512)
SENTENCE = "the answer is 4 2 ."
SYSTEM = " ".join(["you are a tool that can call a function and write code"] * 4)  # > 32 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    """Commits SENTENCE then EOS, two tokens per step, honouring max_new_tokens. `cut_after`
    (tokens) makes the stream break: "abort" ends it with UNAVAILABLE, "eof" ends it cleanly but
    without a finish reason. `step_delay_s` paces the steps (cancellation tests)."""

    def __init__(self, verifier_id: str, tokenizer, publisher: ResidencyPublisher | None = None):
        self.verifier_id = verifier_id
        self.script = list(tokenizer(SENTENCE, add_special_tokens=False)["input_ids"]) + [EOS_ID]
        self.publisher = publisher
        self.requests: list[verifier_pb2.SessionGenerateRequest] = []
        self.cut_after: int | None = None
        self.cut_mode = "abort"
        self.step_delay_s = 0.0
        self.kv_full = False  # refuse every session with RESOURCE_EXHAUSTED
        self.cancelled = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        verifier_pb2_grpc.add_VerifierServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def record(self, active: int = 0) -> VerifierRecord:
        return VerifierRecord(self.verifier_id, self.address, MODEL, WINDOW, 100_000, 0, active)

    def GetInfo(self, request, context):
        return verifier_pb2.VerifierInfo(
            verifier_id=self.verifier_id, model_id=MODEL, vocab_size=512, max_context_tokens=WINDOW,
            kv_capacity_tokens=100_000, eos_token_ids=[EOS_ID], precision="GGUF Q4_1 + Q8_0",
        )

    def Generate(self, request, context):
        self.requests.append(request)
        if self.kv_full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV cache full")
        n = request.sampling.max_new_tokens
        out = self.script[:n]
        finish = common_pb2.FINISH_REASON_STOP if len(self.script) <= n else common_pb2.FINISH_REASON_LENGTH
        for i in range(0, len(out), 2):
            if self.cut_after is not None and i >= self.cut_after:
                if self.cut_mode == "abort":
                    context.abort(grpc.StatusCode.UNAVAILABLE, "verifier process died")
                return
            deadline = time.monotonic() + self.step_delay_s
            while time.monotonic() < deadline:
                if not context.is_active():
                    self.cancelled.set()
                    return
                time.sleep(0.01)
            msg = verifier_pb2.CommittedTokens(
                token_ids=out[i : i + 2], first_index=i, step=verifier_pb2.StepInfo(drafted=2, accepted=1, block_len=2)
            )
            if i + 2 >= len(out):
                steps = (len(out) + 1) // 2
                msg.finish_reason = finish
                msg.stats.CopyFrom(
                    common_pb2.SpeculationStats(
                        drafted=2 * steps, accepted=len(out) - steps, steps=steps,
                        mean_accepted_len=len(out) / steps, prefill_reused_tokens=3,
                    )
                )
            yield msg
        if self.publisher is not None and request.session_id:
            self.publisher.publish_session(request.session_id, self.verifier_id, list(request.context_ids) + out)

    def stop(self) -> None:
        self.server.stop(0)


class FakeDrafter(drafter_pb2_grpc.DrafterServicer):
    def __init__(self):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        drafter_pb2_grpc.add_DrafterServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def GetInfo(self, request, context):
        return drafter_pb2.DrafterInfo(drafter_id="d0", strategies=[common_pb2.DRAFT_STRATEGY_NGRAM])


class Gateway:
    """A real gateway (uvicorn + grpc.aio in one event loop) in a background thread."""

    def __init__(self, tokenizer, model_id: str = MODEL, **settings):
        self.model_id = model_id
        settings = {"http_host": "127.0.0.1", "http_port": 0, "grpc_host": "127.0.0.1", "grpc_port": 0,
                    "shutdown_grace_s": 0.5, "poll_interval_s": 60.0, **settings}
        self.settings = GatewaySettings(**settings)
        self.core: GatewayCore | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main(tokenizer)), daemon=True)
        self._thread.start()
        assert self._ready.wait(15), "gateway did not start"
        if self._error is not None:
            raise self._error
        if self.settings.public_tls is not None:  # the caller makes its own TLS clients
            return
        self.http = httpx.Client(base_url=self.url, timeout=10)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.openai = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=10)

    async def _main(self, tokenizer) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self.core = GatewayCore(self.settings, tokenizer, model_id=self.model_id, max_context_tokens=512,
                                clients=RpcClients(self.settings.tls))

        def ready(http_port: int, grpc_port: int) -> None:
            scheme = "http" if self.settings.public_tls is None else "https"
            self.url, self.grpc_port = f"{scheme}://127.0.0.1:{http_port}", grpc_port
            self._ready.set()

        try:
            await run_gateway(self.core, self.settings, self._stop, on_ready=ready)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def close(self) -> None:
        if self.settings.public_tls is None:
            self.openai.close()
            self.http.close()
            self.channel.close()
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        assert not self._thread.is_alive(), "gateway did not stop"


@pytest.fixture
def rds(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def stack(tiny_tokenizer):
    """Factory of fake verifiers and gateways; everything is stopped at the end."""
    made: list = []

    class Stack:
        def verifier(self, vid: str, publisher=None) -> FakeVerifier:
            made.append(v := FakeVerifier(vid, tiny_tokenizer, publisher))
            return v

        def gateway(self, **settings) -> Gateway:
            made.append(g := Gateway(tiny_tokenizer, **settings))
            return g

    yield Stack()
    for thing in reversed(made):
        thing.close() if isinstance(thing, Gateway) else thing.stop()


def chat(text: str, *history: dict) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": text}]


def test_chat_and_completions_over_openai_client(stack, tiny_tokenizer) -> None:
    drafter = FakeDrafter()
    try:
        v = stack.verifier("va")
        gw = stack.gateway(verifiers=(v.address,), drafters=(drafter.address,))
        expected = tiny_tokenizer.decode(v.script, skip_special_tokens=True)

        resp = gw.openai.chat.completions.create(model=MODEL, messages=chat("hello"), max_tokens=20)
        assert resp.choices[0].message.content == expected == "the answer is 4 2 ."
        assert resp.choices[0].finish_reason == "stop"
        assert resp.usage.completion_tokens == len(v.script)
        spec = resp.usage.model_extra["speculation"]
        assert spec["steps"] == 4 and spec["drafted"] == 8 and spec["accepted"] == 3
        assert spec["acceptance_rate"] == pytest.approx(3 / 8) and spec["mean_accepted_len"] == pytest.approx(7 / 4)
        assert resp.usage.prompt_tokens_details.cached_tokens == 3
        assert resp.model_extra["tandem"]["verifier_id"] == "va"
        sent = v.requests[-1]
        assert sent.drafter_address == drafter.address  # ngram by default, offered by the drafter
        assert sent.sampling.max_new_tokens == 20 and sent.sampling.temperature == 0.0
        assert list(sent.context_ids) == tiny_tokenizer.apply_chat_template(chat("hello"), add_generation_prompt=True)["input_ids"]

        stream = gw.openai.chat.completions.create(
            model=MODEL, messages=chat("hello"), stream=True, stream_options={"include_usage": True},
            extra_body={"speculation": {"strategy": "none"}, "seed": 7},
        )
        events = list(stream)
        assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == expected
        assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "stop"
        assert events[-1].usage.total_tokens == events[-1].usage.prompt_tokens + len(v.script)
        assert v.requests[-1].drafter_address == ""  # strategy none: no drafter
        assert v.requests[-1].speculation.strategy == common_pb2.DRAFT_STRATEGY_NONE

        # Completions: a raw prompt, cut by max_tokens.
        comp = gw.openai.completions.create(model=MODEL, prompt="the answer", max_tokens=3)
        assert comp.choices[0].text == "the answer is" and comp.choices[0].finish_reason == "length"
        chunks = list(gw.openai.completions.create(model=MODEL, prompt="the answer", max_tokens=3, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == "the answer is"

        models = gw.openai.models.list().data
        assert [m.id for m in models] == [MODEL]
        assert models[0].model_extra["verifier_count"] == 1 and models[0].model_extra["max_context_tokens"] == WINDOW
        assert models[0].model_extra["speculation_strategies"] == ["none", "ngram"]
        assert models[0].model_extra["precision"] == "GGUF Q4_1 + Q8_0"  # what the output is lossless against
        assert gw.http.get("/health").json()["status"] == "ok" and gw.http.get("/healthz").status_code == 200
    finally:
        drafter.server.stop(0)


def test_grpc_generate_list_models_and_health(stack, tiny_tokenizer) -> None:
    v = stack.verifier("va")
    gw = stack.gateway(verifiers=(v.address,))
    request = gateway_pb2.GenerateRequest(
        session_id="g1", model=MODEL,
        messages=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")]),
        sampling=common_pb2.SamplingParams(max_new_tokens=4),
    )
    msgs = list(gw.stub.Generate(request, timeout=10))
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == v.script[:4]
    assert [m.first_index for m in msgs] == [0, 2]  # each token once, in order
    assert "".join(m.text for m in msgs) == "the answer is 4"
    last = msgs[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.verifier_id == "va"
    assert last.usage.completion_tokens == 4 and last.stats.steps == 2
    # No input: continue the session from its history (context + the 4 generated tokens).
    first_context = list(v.requests[-1].context_ids)
    list(gw.stub.Generate(gateway_pb2.GenerateRequest(session_id="g1"), timeout=10))
    assert list(v.requests[-1].context_ids) == first_context + v.script[:4]
    assert gw.http.get("/v1/sessions/g1").json()["verifier_id"] == "va"
    assert gw.http.delete("/v1/sessions/g1").json() == {"id": "g1", "deleted": True}
    assert gw.http.get("/v1/sessions/g1").status_code == 404

    with pytest.raises(grpc.RpcError) as err:
        list(gw.stub.Generate(gateway_pb2.GenerateRequest(session_id="nobody"), timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        list(gw.stub.Generate(gateway_pb2.GenerateRequest(model="gpt-4", prompt="hi"), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "gpt-4" in err.value.details()

    (card,) = gw.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models
    assert (card.id, card.is_default, card.verifier_count, card.max_context_tokens) == (MODEL, True, 1, WINDOW)
    health = health_pb2_grpc.HealthStub(gw.channel)
    for service in ("", "tandem.v1.Gateway"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_session_turns_stick_to_their_verifier(stack, rds, redis_url) -> None:
    cfg = ResidencyConfig(url=redis_url)
    pub_a, pub_b = ResidencyPublisher(cfg), ResidencyPublisher(cfg)
    va, vb = stack.verifier("va", pub_a), stack.verifier("vb", pub_b)
    pub_a.register(va.record())
    pub_b.register(vb.record())
    gw = stack.gateway(redis_url=redis_url)  # no static verifiers: both come from Redis

    def ask(sid: str, messages: list[dict]) -> dict:
        r = gw.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10}, headers={"X-Session-Id": sid})
        assert r.status_code == 200, r.text
        return r.json()

    first = ask("conv-1", chat("hello"))
    assert first["tandem"] == {"verifier_id": "va", "routing": "load", "matched_tokens": 0, "session_id": "conv-1",
                               "resumed": 0}
    pub_a.heartbeat(va.record(active=5))  # va is now much busier: load alone would pick vb
    reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    turn2 = chat("and then ?", {"role": "user", "content": "hello"}, reply)
    second = ask("conv-1", turn2)
    assert second["tandem"]["verifier_id"] == "va" and second["tandem"]["routing"] == "session"
    assert len(va.requests) == 2 and not vb.requests
    # The verifier publishes a turn as it ends its call, and the gateway answers only after the
    # call ended: a client's next turn always finds the session in Redis.
    total = second["usage"]["prompt_tokens"] + second["usage"]["completion_tokens"]
    assert rds.hget("tandem:v1:session:conv-1", "resident_tokens") == str(total).encode()
    # So another gateway, which never saw conv-1, finds its verifier through Redis alone.
    gw2 = stack.gateway(redis_url=redis_url)
    r = gw2.http.post("/v1/chat/completions", json={"messages": turn2, "max_tokens": 10, "session_id": "conv-1"})
    assert r.json()["tandem"] == {
        "verifier_id": "va", "routing": "session", "matched_tokens": second["usage"]["prompt_tokens"],
        "session_id": "conv-1", "resumed": 0,
    }
    # Another conversation with the same long system prompt goes where that prefix is resident,
    # once va is not much busier than vb (PREFIX_SLACK: at 5 sessions against 0 it would go to vb).
    pub_a.heartbeat(va.record(active=2))
    other = ask("conv-2", chat("something else"))
    assert other["tandem"]["verifier_id"] == "va" and other["tandem"]["routing"] == "prefix"
    assert other["tandem"]["matched_tokens"] >= 32
    # An unrelated one goes to the least loaded.
    fresh = ask("conv-3", [{"role": "user", "content": "hi"}])
    assert (fresh["tandem"]["verifier_id"], fresh["tandem"]["routing"]) == ("vb", "load")


def test_round_robin_routing_moves_a_session_between_verifiers(stack, rds, redis_url) -> None:
    """`routing="round-robin"` (the baseline residency is measured against): a session's turns go
    to the verifiers in turn, whatever holds its KV, and responses say so."""
    cfg = ResidencyConfig(url=redis_url)
    pub_a, pub_b = ResidencyPublisher(cfg), ResidencyPublisher(cfg)
    va, vb = stack.verifier("va", pub_a), stack.verifier("vb", pub_b)
    pub_a.register(va.record())
    pub_b.register(vb.record())
    gw = stack.gateway(redis_url=redis_url, routing="round-robin")
    history: list[dict] = []
    where = []
    for text in ("hello", "and then ?", "and after that ?"):
        history.append({"role": "user", "content": text})
        r = gw.http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 6},
                         headers={"X-Session-Id": "conv-rr"})
        assert r.status_code == 200, r.text
        tandem = r.json()["tandem"]
        where.append((tandem["verifier_id"], tandem["routing"], tandem["matched_tokens"]))
        history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    assert where == [("va", "round-robin", 0), ("vb", "round-robin", 0), ("va", "round-robin", 0)]
    with pytest.raises(ValueError, match="routing"):
        GatewaySettings(routing="random")


def test_malformed_requests_get_400_and_the_server_keeps_serving(stack) -> None:
    v = stack.verifier("va")
    gw = stack.gateway(verifiers=(v.address,))
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        ({"model": "gpt-4", "messages": msgs}, "'gpt-4' is not served"),
        ({"messages": msgs, "max_tokens": -1}, "max_tokens must be at least 1"),
        ({"messages": msgs, "max_tokens": 10**9}, "limit of 4096"),
        ({"messages": msgs, "max_tokens": 255}, "leaving 252 for the completion"),
        ({"messages": msgs, "temperature": -1}, "temperature"),
        ({"messages": msgs, "temperature": "hot"}, "temperature"),
        ({"messages": msgs, "top_p": 1.5}, "top_p"),
        ({"messages": [{"role": "user", "content": "word " * 300}]}, "context window is 256"),
        ({"messages": msgs, "stop": ["x"] * 9}, "at most 8 stop strings"),
        ({"messages": msgs, "stop": [""]}, "stop string must be 1 to 256"),
        ({"messages": msgs, "logit_bias": {"5": 200}}, "logit_bias"),
        ({"messages": msgs, "logit_bias": {"99999": 1}}, "outside the vocabulary"),
        ({"messages": msgs, "presence_penalty": 3}, "presence_penalty"),
        ({"messages": msgs, "n": 9}, "n must be 1 to 8"),
        ({"messages": msgs, "n": 0}, "n must be 1 to 8"),  # not taken as 1 (found by schemathesis)
        ({"messages": msgs, "n": 0, "stream": True}, "n must be 1 to 8"),
        ({"messages": msgs, "top_k": 2**40}, "top_k"),  # once a 500: the wire's int32 overflowed
        ({"messages": msgs, "stream": 0}, "stream"),  # no coercion: the document says boolean
        ({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "parameters must be a JSON schema object"),
        ({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f", "description": {}}}]},
         "description must be a string"),
        ({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": 0}}},
         "strict"),
        ({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": "f"}}, "tool_choice must be"),
        ({"messages": msgs, "top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"messages": msgs, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": msgs, "tools": [{"type": "web"}]}, "tools[0] must be"),
        ({"messages": msgs, "tools": [], "tool_choice": "required"}, "needs tools"),
        ({"messages": msgs, "functions": []}, "'functions' is not supported"),
        ({"messages": msgs, "speculation": {"strategy": "magic"}}, "speculation.strategy"),
        ({"messages": msgs, "speculation": {"max_draft_tokens": 1000}}, "max_draft_tokens"),
        ({"messages": []}, "messages is empty"),
        ({}, "messages"),
    ]
    for body, needle in cases:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = gw.http.post("/v1/chat/completions", headers={"Content-Type": "application/json"}, **kwargs)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert needle in error["message"] and error["type"] == "invalid_request_error", (body, error)
    r = gw.http.post("/v1/completions", json={"prompt": ""})
    assert r.status_code == 400 and "prompt is empty" in r.json()["error"]["message"]
    assert gw.http.get("/v1/nowhere").status_code == 404
    assert gw.http.get("/v1/sessions/nobody").status_code == 404
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        gw.openai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=0)
    assert v.requests == []  # nothing bad reached the verifier
    r = gw.http.post("/v1/chat/completions", json={"messages": msgs})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "the answer is 4 2 ."


@pytest.mark.parametrize("mode", ["abort", "eof"])
def test_a_stream_cut_midway_is_an_error_not_a_truncation(stack, mode) -> None:
    v = stack.verifier("va")
    v.cut_after, v.cut_mode = 2, mode
    gw = stack.gateway(verifiers=(v.address,))
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with gw.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "the answer"  # what did stream stands
    error = json.loads(events[-1])["error"]
    assert error["code"] == 502 and "incomplete" in error["message"]
    with pytest.raises(openai.APIError, match="incomplete"):
        list(gw.openai.chat.completions.create(model=MODEL, messages=body["messages"], stream=True))

    r = gw.http.post("/v1/chat/completions", json={**body, "stream": False})
    assert r.status_code == 502 and "incomplete" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as err:
        list(gw.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi"), timeout=10))
    assert err.value.code() == grpc.StatusCode.ABORTED
    # A stream cut at the transport is resumed elsewhere when it can be; here no other verifier is there.
    assert gw.http.get("/health").json()["failed"] == {"StreamCut" if mode == "abort" else "UpstreamFailed": 4}


def test_unreachable_verifier_at_connect_is_replaced_by_the_next(stack) -> None:
    va, vb = stack.verifier("va"), stack.verifier("vb")
    gw = stack.gateway(verifiers=(va.address, vb.address))  # polled once at start: both alive
    va.stop()  # va (first by load order) dies before the request
    r = gw.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["tandem"]["verifier_id"] == "vb"
    assert gw.core.stats.connect_failures == 1
    vb.stop()
    r = gw.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and "no verifier available" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as err:
        list(gw.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi"), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("mode", ["abort", "end"])
def test_a_verifier_that_dies_before_the_first_token_is_replaced_by_the_next(stack, mode) -> None:
    """The verifier accepts the call and dies (or ends the stream) before its first message: the
    request goes to the next verifier and the client gets the whole answer, once, as if nothing
    had happened (issue 61: a retry the client never sees)."""
    va, vb = stack.verifier("va"), stack.verifier("vb")
    va.cut_after, va.cut_mode = 0, mode
    gw = stack.gateway(verifiers=(va.address, vb.address))
    r = gw.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["tandem"]["verifier_id"] == "vb"
    assert r.json()["choices"][0]["message"]["content"] == SENTENCE
    assert len(va.requests) == 1 and len(vb.requests) == 1
    va.cut_after = None


def test_full_verifiers_are_skipped_then_reported_as_overload(stack) -> None:
    va, vb = stack.verifier("va"), stack.verifier("vb")
    va.kv_full = True
    gw = stack.gateway(verifiers=(va.address, vb.address))
    body = {"messages": [{"role": "user", "content": "hi"}]}
    r = gw.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["tandem"]["verifier_id"] == "vb"
    # With vb left to try, va was asked to queue the request only briefly; vb, the last, for its own wait
    assert [q.admission_wait_ms for q in va.requests] == [2000] and [q.admission_wait_ms for q in vb.requests] == [0]
    vb.kv_full = True
    r = gw.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 429 and "KV cache is full" in r.json()["error"]["message"]
    assert r.headers["Retry-After"] == "1"
    with pytest.raises(grpc.RpcError) as err:
        list(gw.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi"), timeout=10))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_redis_unreachable_still_serves(stack) -> None:
    v = stack.verifier("va")
    gw = stack.gateway(verifiers=(v.address,), redis_url=f"redis://127.0.0.1:{free_port()}/0")
    r = gw.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "session_id": "s"})
    assert r.status_code == 200 and r.json()["tandem"]["routing"] == "redis-unavailable"
    health = gw.http.get("/health")
    assert health.status_code == 200
    assert health.json()["redis"] == "unavailable" and health.json()["redis_errors"] >= 1


def test_client_disconnect_cancels_the_verifier_call(stack) -> None:
    v = stack.verifier("va")
    v.step_delay_s = 1.0  # a request takes seconds: the client gives up long before
    gw = stack.gateway(verifiers=(v.address,))
    with gw.http.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))  # the first step arrived
    assert v.cancelled.wait(15), "the verifier call was not cancelled"
    # Non-streaming: the client gives up while the verifier is still generating.
    v.cancelled.clear()
    with pytest.raises(httpx.ReadTimeout):
        gw.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=0.5)
    assert v.cancelled.wait(15), "the verifier call was not cancelled"


@pytest.mark.slow
def test_serve_stops_gracefully_on_sigterm(tmp_path, tiny_tokenizer) -> None:
    from transformers import LlamaConfig

    model_dir = tmp_path / "tiny"
    tiny_tokenizer.save_pretrained(model_dir)
    LlamaConfig(vocab_size=512, max_position_embeddings=512).save_pretrained(model_dir)
    http_port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.tools.cli", "gateway", "--model", str(model_dir), "--host", "127.0.0.1",
         "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--verifier", f"127.0.0.1:{free_port()}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.1)
        r = httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=5)
        assert r.json()["data"][0]["id"] == "tiny"
        assert httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5).status_code == 503  # no verifier
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "gateway stopping" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_detokenizer_deltas_concatenate_to_the_decoded_text() -> None:
    """With a byte-level BPE, tokens may end inside a UTF-8 character: the text of such a token is
    held back until the character completes, and the deltas add up to decode(all tokens)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tandem.contract.text import Detokenizer

    corpus = ["naïve café déjà vu", "日本語 テキスト", "emoji 🎉🎉 party", "def f(x):\n    return x ** 2"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    rng = random.Random(0)
    for text in [*corpus, "unseen: 漢字 and ü"]:
        ids = tok(text)["input_ids"]
        for _ in range(5):
            detok, out, i = Detokenizer(tok), [], 0
            while i < len(ids):
                k = rng.randint(1, 3)
                out.append(detok.push(ids[i : i + k], final=i + k >= len(ids)))
                i += k
            assert "".join(out) == tok.decode(ids) == text
            assert not any("\ufffd" in piece for piece in out)


def _read_sse(gw, body: dict, on_first=None) -> list[str]:
    """The data lines of a streamed chat completion; `on_first()` runs once the first one arrived."""
    events = []
    with gw.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1 and on_first is not None:
                    on_first()
    return events


def test_a_draining_gateway_refuses_new_work_and_cuts_late_streams_with_an_error_event(stack) -> None:
    """SIGTERM's drain, step by step: new requests get 503 (Retry-After) / UNAVAILABLE and readiness
    turns 503 while the ports stay open; at the end of the grace a running stream gets an SSE error
    event of type service_unavailable_error (never a silent end, never [DONE])."""
    v = stack.verifier("va")
    v.step_delay_s = 0.5  # 4 steps: the stream runs for 2 s
    gw = stack.gateway(verifiers=(v.address,))
    body = {"messages": [{"role": "user", "content": "hi"}]}

    def drain_then_cut():
        gw.core.begin_drain()
        r = gw.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.headers["Retry-After"] and "shutting down" in r.json()["error"]["message"]
        health = gw.http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        with pytest.raises(grpc.RpcError) as err:
            list(gw.stub.Generate(gateway_pb2.GenerateRequest(prompt="hi"), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        gw._loop.call_soon_threadsafe(gw.core.cut_streams)

    events = _read_sse(gw, body, on_first=drain_then_cut)
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["type"] == "service_unavailable_error" and "shutting down" in error["message"]
    assert gw.core.stats.cut_at_shutdown == 1
    assert v.cancelled.wait(5), "the cut ended the verifier call too"


@pytest.mark.parametrize("grace_s", [0.2, 5.0])
def test_sigterm_drain_lets_streams_finish_within_the_grace_and_cuts_the_rest(tiny_tokenizer, stack, grace_s) -> None:
    """The whole drain as serve() runs it at SIGTERM (run_gateway's stop): a stream shorter than the
    grace completes with [DONE]; a longer one ends with the error event."""
    v = stack.verifier("va")
    v.step_delay_s = 0.4  # the stream takes ~1.6 s
    gw = Gateway(tiny_tokenizer, model="tiny", verifiers=(v.address,), shutdown_grace_s=grace_s)
    try:
        stopper = threading.Thread(target=lambda: gw._loop.call_soon_threadsafe(gw._stop.set))
        events = _read_sse(gw, {"messages": [{"role": "user", "content": "hi"}]}, on_first=stopper.start)
    finally:
        gw.close()
    if grace_s > 2:
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                       if json.loads(e)["choices"]) == SENTENCE
    else:
        assert "[DONE]" not in events and json.loads(events[-1])["error"]["type"] == "service_unavailable_error"


def test_the_request_timeout_header(stack) -> None:
    """X-Request-Timeout: past it the request ends with 504 (a stream: an SSE error event) and the
    verifier call is cancelled; a malformed value is a 400."""
    v = stack.verifier("va")
    v.step_delay_s = 1.0
    gw = stack.gateway(verifiers=(v.address,))
    body = {"messages": [{"role": "user", "content": "hi"}]}
    r = gw.http.post("/v1/chat/completions", json=body, headers={"X-Request-Timeout": "0.5"})
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
    assert v.cancelled.wait(5)
    for bad in ("soon", "0", "-1", "nan", "inf"):
        r = gw.http.post("/v1/chat/completions", json=body, headers={"X-Request-Timeout": bad})
        assert r.status_code == 400 and "X-Request-Timeout" in r.json()["error"]["message"], bad
