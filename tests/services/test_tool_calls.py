"""Tool calling's pure parts (services/gateway/tool_calls.py): choosing, the call grammar, rendering by a
template with tool support or by the Hermes convention, and parsing calls out of text."""

from __future__ import annotations

import json

import pytest

from tandem.engine.model.tokenizer import apply_chat_template
from tandem.services.gateway import tool_calls
from tandem.services.gateway.errors import InvalidRequest

FN = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OTHER = {"type": "function", "function": {"name": "get_time"}}


def test_choosing_functions():
    fns, mode = tool_calls.chosen([FN, OTHER], "auto")
    assert mode == "auto" and [f["name"] for f in fns] == ["get_weather", "get_time"]
    assert tool_calls.chosen([FN], "none") == ([], "none")
    assert tool_calls.chosen([FN, OTHER], {"type": "function", "function": {"name": "get_time"}})[0][0]["name"] == "get_time"
    for bad, choice in (([FN], {"type": "function", "function": {"name": "nope"}}), ([], "required"),
                        ([{"type": "function", "function": {"name": "bad name!"}}], "auto"), ([FN, FN], "auto"),
                        ([FN], "sometimes")):
        with pytest.raises(InvalidRequest):
            tool_calls.chosen(bad, choice)


def test_call_grammar_allows_exactly_the_functions():
    g = tool_calls.call_grammar(tool_calls.chosen([FN, OTHER], "required")[0])
    schema = json.loads(g.value)
    assert g.kind == "json_schema" and [o["properties"]["name"]["const"] for o in schema["anyOf"]] == ["get_weather", "get_time"]
    assert all(o["required"] == ["name", "arguments"] for o in schema["anyOf"])
    llama = json.loads(tool_calls.call_grammar(tool_calls.chosen([FN], "required")[0], tool_calls.DIALECTS["llama3"]).value)
    assert llama["required"] == ["name", "parameters"] and "arguments" not in llama["properties"]  # the family's key


def test_parse_calls_out_of_text():
    plan = _plan([FN, OTHER], "auto")
    unknown = '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    content, calls = tool_calls.parse('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
                                 + unknown, plan)
    assert content == "Let me check. " + unknown and [c.name for c in calls] == ["get_weather"]  # not a call: left as text
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].id.startswith("call_")
    assert tool_calls.parse("no calls here", plan) == ("no calls here", [])
    assert tool_calls.parse("<tool_call>{not json</tool_call>", plan) == ("<tool_call>{not json</tool_call>", [])
    content, calls = tool_calls.parse('{"name": "get_time", "arguments": {}}', _plan([FN, OTHER], "required"))
    assert content is None and calls[0].name == "get_time"


def _plan(fns, mode, dialect="hermes", parallel=True):
    return tool_calls.ToolPlan(tuple(tool_calls.chosen(fns, mode)[0]), mode, tool_calls.DIALECTS[dialect], parallel)


TWO_CALLS = {  # how each family writes two calls (get_weather for Paris, then get_time)
    "hermes": 'On it. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
}


@pytest.mark.parametrize("dialect", sorted(TWO_CALLS))
def test_each_familys_calls_are_parsed_in_its_dialect(dialect):
    content, calls = tool_calls.parse(TWO_CALLS[dialect], _plan([FN, OTHER], "auto", dialect))
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {}]
    assert content == ("On it." if dialect == "hermes" else None)
    _, first = tool_calls.parse(TWO_CALLS[dialect], _plan([FN, OTHER], "auto", dialect, parallel=False))
    assert [c.name for c in first] == ["get_weather"]  # parallel_tool_calls false: the first call only
    prose = "Paris is sunny [citation needed]; {braces} too."
    assert tool_calls.parse(prose, _plan([FN, OTHER], "auto", dialect)) == (prose, [])


def test_llama3_and_mistral_calls_without_their_special_tokens():
    """Text decoded without special tokens loses <|python_tag|> and [TOOL_CALLS]: the call object
    (array) opening the response is still the call; prose after a Llama 3 call stays content."""
    content, calls = tool_calls.parse(' {"name": "get_time", "parameters": {"city": "Oslo"}} Done.', _plan([FN, OTHER], "auto", "llama3"))
    assert [c.name for c in calls] == ["get_time"] and json.loads(calls[0].arguments) == {"city": "Oslo"} and content == "Done."
    content, calls = tool_calls.parse('[{"name": "get_time", "arguments": {"city": "Oslo"}}]', _plan([FN, OTHER], "auto", "mistral"))
    assert [c.name for c in calls] == ["get_time"] and content is None
    assert tool_calls.parse('I said {"name": "get_time"} once.', _plan([FN, OTHER], "auto", "llama3"))[1] == []  # not at the start
    # A Mistral array whose first call names no tool: the known one is still a call, and the
    # array (one span for all its calls) is not left in the content.
    content, calls = tool_calls.parse('[TOOL_CALLS] [{"name": "nope", "arguments": {}}, {"name": "get_time", "arguments": {}}]',
                                 _plan([FN, OTHER], "auto", "mistral"))
    assert [c.name for c in calls] == ["get_time"] and content is None


@pytest.mark.parametrize("dialect", sorted(TWO_CALLS))
def test_a_stream_never_sends_part_of_a_call_as_content(dialect):
    """hold_from, character by character: what it lets out is content in the finished text, and
    text before the first call gets out before the end (where the family allows prose first)."""
    d = tool_calls.DIALECTS[dialect]
    text = TWO_CALLS[dialect]
    spans, _ = tool_calls.calls_in(text, _plan([FN, OTHER], "auto", dialect))
    first_call = spans[0][0]
    sent = 0
    for i in range(len(text) + 1):
        sent = max(sent, d.hold_from(text[:i]))
        assert sent <= first_call, (text[:i], sent)
    assert sent == first_call
    prose = "The weather is fine."
    assert d.hold_from(prose) == len(prose)


def test_rendering_by_the_hermes_convention_without_template_support(tiny_tokenizer):
    fns, _ = tool_calls.chosen([FN], "auto")
    msgs = [{"role": "user", "content": "weather in paris"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    support = tool_calls.detect(tiny_tokenizer)
    assert (support.renderer, support.label, support.why) == (tool_calls.GATEWAY, "gateway/hermes", "has no tool support")
    ids = tool_calls.render(tiny_tokenizer, msgs, fns, apply_chat_template, support)
    text = tiny_tokenizer.decode(ids)  # (this small test vocabulary spells unknown words as <unk>)
    assert text.startswith("<|system|>") and '" function "' in text  # the preamble lists the function
    assert "< tool _ call > {" in text  # the earlier call, in the convention
    assert "<|tool|>" in text  # the tool result, as its own turn


def test_rendering_by_a_template_that_knows_tools(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = ("{% if tools %}<|system|> tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
                         "<|end|> {% endif %}" + tiny_tokenizer.chat_template)
    assert tool_calls.detect(tok).renderer == tool_calls.GATEWAY and "does not parse" in tool_calls.detect(tok).why  # no known dialect
    tok.chat_template = tok.chat_template.replace("tools: ", "tools ( answer with <tool_call> ): ")
    support = tool_calls.detect(tok)
    assert (support.renderer, support.label) == (tool_calls.TEMPLATE, "template/hermes")
    fns, _ = tool_calls.chosen([FN], "auto")
    ids = tool_calls.render(tok, [{"role": "user", "content": "hi"}], fns, apply_chat_template, support)
    plain = apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    assert ids != plain and tok.decode(ids).startswith("<|system|>")
    assert "signatures" not in tok.decode(ids)  # the template's own rendering, not the convention's preamble


def test_a_template_without_tool_support_is_said_or_refused(tiny_tokenizer):
    """The tiny model's template has no tool support: by default each response with tools says
    tandem.tool_format "gateway/hermes" (the convention was used); with tool_fallback off the request is
    refused with the reason over HTTP and gRPC, and never reaches a verifier."""
    import grpc

    from test_gateway import FakeVerifier, Gateway
    from tandem.v1 import gateway_pb2

    v = FakeVerifier("va", tiny_tokenizer)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [FN], "max_tokens": 4}
    gw = Gateway(tiny_tokenizer, verifiers=(v.address,))
    try:
        reply = gw.http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200 and reply.json()["tandem"]["tool_format"] == "gateway/hermes"
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
