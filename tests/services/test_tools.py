"""Tool calling's pure parts (services/gateway/tools.py): choosing, the call grammar, rendering by a
template with tool support or by the Hermes convention, and parsing calls out of text."""

from __future__ import annotations

import json

import pytest

from tandem.engine.models import apply_chat_template
from tandem.services.gateway import tools
from tandem.services.gateway.errors import InvalidRequest

FN = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OTHER = {"type": "function", "function": {"name": "get_time"}}


def test_choosing_functions():
    fns, mode = tools.chosen([FN, OTHER], "auto")
    assert mode == "auto" and [f["name"] for f in fns] == ["get_weather", "get_time"]
    assert tools.chosen([FN], "none") == ([], "none")
    assert tools.chosen([FN, OTHER], {"type": "function", "function": {"name": "get_time"}})[0][0]["name"] == "get_time"
    for bad, choice in (([FN], {"type": "function", "function": {"name": "nope"}}), ([], "required"),
                        ([{"type": "function", "function": {"name": "bad name!"}}], "auto"), ([FN, FN], "auto"),
                        ([FN], "sometimes")):
        with pytest.raises(InvalidRequest):
            tools.chosen(bad, choice)


def test_call_grammar_allows_exactly_the_functions():
    g = tools.call_grammar(tools.chosen([FN, OTHER], "required")[0])
    schema = json.loads(g.value)
    assert g.kind == "json_schema" and [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["get_weather", "get_time"]


def test_parse_calls_out_of_text():
    fns, _ = tools.chosen([FN, OTHER], "auto")
    content, calls = tools.parse('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                                 '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', fns, "auto")
    assert content.startswith("Let me check.") and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].id.startswith("call_")
    assert tools.parse("no calls here", fns, "auto") == ("no calls here", [])
    content, calls = tools.parse('{"name": "get_time", "arguments": {}}', fns, "required")
    assert content is None and calls[0].name == "get_time"


def test_rendering_by_the_hermes_convention_without_template_support(tiny_tokenizer):
    fns, _ = tools.chosen([FN], "auto")
    msgs = [{"role": "user", "content": "weather in paris"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    ids = tools.render(tiny_tokenizer, msgs, fns, apply_chat_template)
    text = tiny_tokenizer.decode(ids)  # (this small test vocabulary spells unknown words as <unk>)
    assert text.startswith("<|system|>") and '" function "' in text  # the preamble lists the function
    assert "< tool _ call > {" in text  # the earlier call, in the convention
    assert "<|tool|>" in text  # the tool result, as its own turn


def test_rendering_by_a_template_that_knows_tools(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = ("{% if tools %}<|system|> tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
                         "<|end|> {% endif %}" + tiny_tokenizer.chat_template)
    fns, _ = tools.chosen([FN], "auto")
    ids = tools.render(tok, [{"role": "user", "content": "hi"}], fns, apply_chat_template)
    plain = apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    assert ids != plain and tok.decode(ids).startswith("<|system|>")
    assert "call" not in tok.decode(ids)  # the template's own rendering, not the convention's preamble
    assert tools.tool_format(tok) == tools.TEMPLATE and tools.tool_format(tiny_tokenizer) == tools.HERMES


def test_a_template_without_tool_support_is_said_or_refused(tiny_tokenizer):
    """The tiny model's template has no tool support: by default each response with tools says
    tandem.tool_format "hermes" (the convention was used); with tool_fallback off the request is
    refused with the reason over HTTP and gRPC, and never reaches a verifier."""
    import grpc

    from test_gateway import FakeVerifier, Gateway
    from tandem.v1 import gateway_pb2

    v = FakeVerifier("va", tiny_tokenizer)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [FN], "max_tokens": 4}
    gw = Gateway(tiny_tokenizer, verifiers=(v.address,))
    try:
        reply = gw.http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200 and reply.json()["tandem"]["tool_format"] == "hermes"
        plain = gw.http.post("/v1/chat/completions", json={**body, "tools": None})
        assert "tool_format" not in plain.json()["tandem"]  # said only where tools were rendered
    finally:
        gw.close()
    seen = len(v.requests)
    gw = Gateway(tiny_tokenizer, verifiers=(v.address,), tool_fallback=False)
    try:
        reply = gw.http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400 and "has no tool support" in reply.json()["error"]["message"]
        chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
        with pytest.raises(grpc.RpcError) as err:
            list(gw.stub.Generate(gateway_pb2.GenerateRequest(messages=chat, tools=[gateway_pb2.Tool(name="f")]),
                                  timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no tool support" in err.value.details()
        assert gw.http.post("/v1/chat/completions", json={**body, "tools": None}).status_code == 200
        assert len(v.requests) == seen + 1  # only the request without tools went on
    finally:
        gw.close()


def test_grpc_tool_requests_are_checked(tiny_tokenizer):
    import grpc

    from test_gateway import FakeVerifier, Gateway
    from tandem.v1 import gateway_pb2

    v = FakeVerifier("va", tiny_tokenizer)
    gw = Gateway(tiny_tokenizer, verifiers=(v.address,))
    try:
        chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
        bad = [
            gateway_pb2.GenerateRequest(prompt="hi", tools=[gateway_pb2.Tool(name="f")]),  # tools need a chat
            gateway_pb2.GenerateRequest(messages=chat, tools=[gateway_pb2.Tool(name="f", parameters_json="{no")]),
            gateway_pb2.GenerateRequest(messages=chat, tools=[gateway_pb2.Tool(name="f")],
                                        tool_choice=gateway_pb2.ToolChoice(function="g")),
            gateway_pb2.GenerateRequest(messages=chat, tool_choice=gateway_pb2.ToolChoice(mode="required")),
        ]
        for req in bad:
            with pytest.raises(grpc.RpcError) as err:
                list(gw.stub.Generate(req, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
        assert v.requests == []
        out = list(gw.stub.Generate(gateway_pb2.GenerateRequest(messages=chat, tools=[gateway_pb2.Tool(name="f")]),
                                    timeout=10))
        assert out[-1].finish_reason and not out[-1].tool_calls  # auto: the fake verifier's text holds no call
    finally:
        gw.close()
        v.stop()
