"""Tool calls in each model family's dialect, end to end through a real gateway (HTTP with the
official `openai` client, and gRPC): SmolLM2's real BPE tokenizer given chat templates written here
in the style of each family (Hermes / Qwen, Llama 3, Mistral), and a scripted verifier that writes
the family's call text, so what is checked is the gateway's part: detection, rendering of tools and
of earlier calls, parsing, and a stream that never shows part of a call as content."""

from __future__ import annotations

import copy
import json

import grpc
import pytest

from tandem.engine.model.tokenizer import load_tokenizer
from tandem.services.gateway import tool_calls
from tandem.v1 import gateway_pb2

from test_gateway import EOS_ID, FakeVerifier, Gateway

# Our own minimal templates, each teaching the model its family's convention.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nFunctions:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTo call a function, answer with JSON {\"name\": function name, "
    "\"parameters\": its arguments}.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ 'ipython' if m.role == 'tool' else m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{%- for m in messages %}{% if m.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]"
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% else %}{{ m.content }}{% endif %}"
    "{% endfor %}"
)
TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "mistral": MISTRAL_TEMPLATE}

CALLS = {  # what the scripted verifier writes: prose, then a call to get_weather (Hermes only allows prose first)
    "hermes": 'Checking the sky. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]',
}
PROSE = {"hermes": "Checking the sky.", "llama3": None, "mistral": None}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol_tokenizer():
    return load_tokenizer("default", progress=False)[1]


def _family(tokenizer, family: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATES[family]
    return tok


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_each_familys_template_is_detected(smol_tokenizer, family):
    support = tool_calls.detect(_family(smol_tokenizer, family))
    assert (support.renderer, support.dialect.name) == (tool_calls.TEMPLATE, family)
    assert tool_calls.detect(smol_tokenizer).renderer == tool_calls.GATEWAY  # SmolLM2's own template has no tool support


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_calls_in_each_familys_dialect_through_the_gateway(smol_tokenizer, family):
    tok = _family(smol_tokenizer, family)
    v = FakeVerifier("va", tok)
    v.script = list(tok(CALLS[family], add_special_tokens=False)["input_ids"]) + [EOS_ID]
    gw = Gateway(tok, verifiers=(v.address,))
    try:
        reply = gw.http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "max_tokens": 100})
        body = reply.json()
        assert reply.status_code == 200 and body["tandem"]["tool_format"] == f"template/{family}"
        msg = body["choices"][0]["message"]
        assert body["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] == PROSE[family]
        assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
        assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
        prompt = tok.decode(list(v.requests[-1].context_ids))
        assert prompt == tok.apply_chat_template(ASK, tools=[WEATHER], add_generation_prompt=True, tokenize=False)

        # Streamed: the prose arrives as content before the end, the call only as delta.tool_calls.
        events = list(gw.openai.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], max_tokens=100,
                                                        stream=True))
        contents = [e.choices[0].delta.content for e in events if e.choices and e.choices[0].delta.content]
        deltas = [tc for e in events if e.choices for tc in (e.choices[0].delta.tool_calls or [])]
        assert ("".join(contents).strip() or None) == PROSE[family]
        assert not any(mark in c for c in contents for mark in ("{", "<tool_call", "[TOOL"))
        assert [d.function.name for d in deltas] == ["get_weather"] and deltas[0].id
        assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "tool_calls"
        if PROSE[family]:  # it streamed: sent before the call's tokens had all arrived
            first_content = next(i for i, e in enumerate(events) if e.choices and e.choices[0].delta.content)
            assert first_content < len(events) - 3

        # The next turn: the earlier call (arguments as OpenAI sends them, JSON text) reaches the
        # template as an object, and the tool result follows in the family's form.
        turn2 = ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": deltas[0].id, "type": "function",
             "function": {"name": "get_weather", "arguments": deltas[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": deltas[0].id, "content": "21 C, clear"}]
        assert gw.openai.chat.completions.create(model="tiny", messages=turn2, tools=[WEATHER], max_tokens=4)
        prompt = tok.decode(list(v.requests[-1].context_ids))
        assert '{"city": "Paris", "unit": "C"}' in prompt and "21 C, clear" in prompt
        assert '"{\\"city' not in prompt  # not the arguments' JSON text quoted as a string
    finally:
        gw.close()
        v.stop()


def test_parallel_tool_calls_false_keeps_the_first_call(smol_tokenizer):
    tok = _family(smol_tokenizer, "llama3")
    v = FakeVerifier("va", tok)
    two = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; {"name": "get_weather", "parameters": {"city": "Rome", "unit": "C"}}'
    v.script = list(tok(two, add_special_tokens=False)["input_ids"]) + [EOS_ID]
    gw = Gateway(tok, verifiers=(v.address,))
    try:
        body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 100}
        both = gw.http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]
        one = gw.http.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False}).json()
        assert [json.loads(c["function"]["arguments"])["city"] for c in both] == ["Paris", "Rome"]
        assert [json.loads(c["function"]["arguments"])["city"] for c in one["choices"][0]["message"]["tool_calls"]] == ["Paris"]

        chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=ASK[0]["content"])])
        tool = gateway_pb2.Tool(name="get_weather", parameters_json=json.dumps(WEATHER["function"]["parameters"]))
        for parallel, cities in ((None, ["Paris", "Rome"]), (False, ["Paris"]), (True, ["Paris", "Rome"])):
            req = gateway_pb2.GenerateRequest(messages=chat, tools=[tool])
            if parallel is not None:
                req.parallel_tool_calls = parallel
            last = list(gw.stub.Generate(req, timeout=10))[-1]
            assert [json.loads(c.arguments_json)["city"] for c in last.tool_calls] == cities, parallel
    finally:
        gw.close()
        v.stop()


def test_a_template_with_an_unknown_call_format_falls_back_and_says_why(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = ("{% if tools %}Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
                         + smol_tokenizer.chat_template)
    support = tool_calls.detect(tok)
    assert support.label == "gateway/hermes" and "does not parse" in support.why
    v = FakeVerifier("va", tok)
    gw = Gateway(tok, verifiers=(v.address,), tool_fallback=False)
    try:
        reply = gw.http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "max_tokens": 4})
        assert reply.status_code == 400 and "call format the gateway does not parse" in reply.json()["error"]["message"]
        assert v.requests == []
    finally:
        gw.close()
        v.stop()
