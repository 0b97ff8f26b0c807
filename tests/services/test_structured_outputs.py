"""Structured output through the whole stack on the embedded SmolLM2 (real verifier, real drafter,
real gateway, the official `openai` client): `response_format` json_schema parsed by the client's
`parse` helper, json_object, and Tandem's regex grammar, each with speculation on giving exactly the
text of plain decoding."""

from __future__ import annotations

import json
import time

import pydantic
import pytest
import redis

from tandem.services.drafter.core import DrafterCore
from tandem.services.drafter.server import build_server as build_drafter
from tandem.services.drafter.settings import DrafterSettings
from tandem.services.verifier.core import VerifierCore
from tandem.services.verifier.drafter_client import GrpcDrafterConnector
from tandem.services.verifier.server import build_server as build_verifier
from tandem.services.verifier.settings import VerifierSettings
from tandem.serving.residency import ResidencyPublisher

from smollm_fixture import smollm  # noqa: F401 (fixture)
from test_gateway import Gateway

pytestmark = pytest.mark.slow


class City(pydantic.BaseModel):
    name: str
    country: str
    population_millions: float


@pytest.fixture(scope="module")
def stack(smollm, redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    dcore = DrafterCore(DrafterSettings(drafter_id="d0"))
    dserver, dport = build_drafter(dcore)
    dserver.start()
    drafter = f"127.0.0.1:{dport}"
    core = VerifierCore(VerifierSettings(verifier_id="v0", port=0, draft_wait_ms=200, drafters=(drafter,)),
                        smollm, publisher=ResidencyPublisher(redis_url), connector=GrpcDrafterConnector())
    server, port, _ = build_verifier(core)
    server.start()
    core.start(f"127.0.0.1:{port}")
    gw = Gateway(smollm.tokenizer, model_id=smollm.model_id, verifiers=(f"127.0.0.1:{port}",), drafters=(drafter,),
                 poll_interval_s=0.3)
    time.sleep(0.5)
    yield gw
    gw.close()
    server.stop(None)
    core.stop()
    dserver.stop(None)


MESSAGES = [{"role": "user", "content": "Give the largest city of Japan as JSON with its name, country and "
                                        "population in millions."}]


def _spec(strategy):
    return {"speculation": {"strategy": strategy, "adaptive": False, "max_draft_tokens": 6}}


def test_json_schema_with_the_clients_parse_helper(stack):
    texts = {}
    for strategy in ("none", "ngram"):
        reply = stack.openai.chat.completions.parse(model="default", messages=MESSAGES, response_format=City,
                                                    max_tokens=60, temperature=0, extra_body=_spec(strategy))
        msg = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, City) and msg.parsed.name
        texts[strategy] = msg.content
        assert reply.usage.model_extra["speculation"]["drafted"] > 0 or strategy == "none"
    assert texts["ngram"] == texts["none"]


def test_json_object_and_regex(stack):
    for body in ({"response_format": {"type": "json_object"}},
                 {"grammar": {"type": "regex", "value": r"(Tokyo|Osaka|Kyoto), [A-Z][a-z]+\."}}):
        outs = []
        for strategy in ("none", "ngram"):
            reply = stack.openai.chat.completions.create(model="default", messages=MESSAGES, max_tokens=40,
                                                         temperature=0, extra_body={**body, **_spec(strategy)})
            outs.append(reply.choices[0].message.content)
        assert outs[0] == outs[1]
        if "response_format" in body:
            json.loads(outs[0])
        else:
            assert outs[0].split(",")[0] in ("Tokyo", "Osaka", "Kyoto") and outs[0].endswith(".")


def test_a_bad_schema_is_a_400(stack):
    r = stack.http.post("/v1/chat/completions", json={
        "model": "default", "messages": MESSAGES, "max_tokens": 4,
        "grammar": {"type": "regex", "value": "(unclosed"}})
    assert r.status_code == 400 and "does not compile" in r.json()["error"]["message"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_required_and_named_tool_calls_with_speculation_equal_plain(stack):
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "get_time"}}, "get_time")):
        calls = []
        for strategy in ("none", "ngram"):
            reply = stack.openai.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME],
                                                         tool_choice=choice, max_tokens=60, temperature=0,
                                                         extra_body=_spec(strategy))
            assert reply.choices[0].finish_reason == "tool_calls", reply.choices[0].message
            call = reply.choices[0].message.tool_calls[0]
            assert call.type == "function" and call.function.name in ("get_weather", "get_time")
            if name:
                assert call.function.name == name
            args = json.loads(call.function.arguments)
            assert "city" in args
            calls.append((call.function.name, call.function.arguments))
        assert calls[0] == calls[1], "speculation changed the call"


def test_a_required_call_in_the_llama3_dialect_with_speculation_equals_plain(stack, smollm):
    """The model's template in Llama 3's style: tools rendered by it, and the required call's grammar
    puts the arguments under "parameters" as that family writes them; the same call with and
    without speculation."""
    import copy

    from test_tool_dialects import LLAMA3_TEMPLATE

    tok = copy.deepcopy(smollm.tokenizer)
    tok.chat_template = LLAMA3_TEMPLATE
    gw = Gateway(tok, model_id=smollm.model_id, verifiers=stack.settings.verifiers, drafters=stack.settings.drafters,
                 poll_interval_s=0.3)
    try:
        time.sleep(0.5)
        calls = []
        for strategy in ("none", "ngram"):
            reply = gw.openai.chat.completions.with_raw_response.create(
                model="default", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0,
                extra_body=_spec(strategy))
            assert json.loads(reply.text)["tandem"]["tool_format"] == "template/llama3"
            choice = reply.parse().choices[0]
            assert choice.finish_reason == "tool_calls", choice.message
            call = choice.message.tool_calls[0]
            assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
            assert reply.parse().usage.model_extra["speculation"]["drafted"] > 0 or strategy == "none"
            calls.append(call.function.arguments)
        assert calls[0] == calls[1], "speculation changed the call"
    finally:
        gw.close()


def test_streamed_tool_call_and_a_second_turn_with_its_result(stack):
    stream = stack.openai.chat.completions.create(model="default", messages=ASK, tools=[WEATHER],
                                                  tool_choice="required", max_tokens=60, temperature=0, stream=True)
    events = list(stream)
    deltas = [tc for e in events if e.choices for tc in (e.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather"
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "tool_calls"
    turn2 = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": deltas[0].id, "type": "function", "function": {"name": "get_weather", "arguments": deltas[0].function.arguments}}]},
        {"role": "tool", "tool_call_id": deltas[0].id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    reply = stack.openai.chat.completions.create(model="default", messages=turn2, tools=[WEATHER], max_tokens=30,
                                                 temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_calls_over_grpc(stack):
    from tandem.v1 import common_pb2, gateway_pb2

    tool = gateway_pb2.Tool(name="get_weather", description=WEATHER["function"]["description"],
                            parameters_json=json.dumps(WEATHER["function"]["parameters"]))
    req = gateway_pb2.GenerateRequest(
        messages=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=ASK[0]["content"])]),
        sampling=common_pb2.SamplingParams(max_new_tokens=60), tools=[tool],
        tool_choice=gateway_pb2.ToolChoice(function="get_weather"))
    msgs = list(stack.stub.Generate(req, timeout=120))
    calls = msgs[-1].tool_calls
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments_json)
    http = stack.openai.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], max_tokens=60,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                temperature=0)
    assert json.loads(http.choices[0].message.tool_calls[0].function.arguments) == json.loads(calls[0].arguments_json)
