"""Requests exactly as third-party clients send them (captured from the tools, docs/benchmarks.md
"Third-party clients"), through a real gateway over HTTP: guidellm 0.8's streaming chat request
(content parts, `stream_options.continuous_usage_stats`, `max_completion_tokens`, `ignore_eos`,
an extra body field) and lm-eval 0.4's local-chat-completions request (an empty bearer token,
`stop: []`, a seed). And the gateway's default strategy (`--speculation`), which serves clients
that cannot send Tandem's `speculation` field."""

from __future__ import annotations

import json

from tandem.contract.params import DraftStrategy, SpecConfig
from tandem.v1 import common_pb2

from test_gateway import FakeVerifier, Gateway

GUIDELLM_BODY = {  # guidellm run --backend kind=openai_http ... (its request, as sent)
    "model": "tiny", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_completion_tokens": 8, "ignore_eos": True, "speculation": {"strategy": "none"},
    "messages": [{"role": "user", "content": [{"type": "text", "text": "1 0 m0 the answer is what"}]}],
}
LM_EVAL_BODY = {  # lm_eval --model local-chat-completions (its request, as sent)
    "messages": [{"role": "user", "content": "the answer is what"}], "model": "tiny", "max_tokens": 8,
    "temperature": 0.0, "stop": [], "seed": 1234,
}


def _events(reply) -> list[dict]:
    return [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]


def test_guidellms_streaming_request_gets_usage_on_every_chunk(tiny_tokenizer):
    v = FakeVerifier("va", tiny_tokenizer)
    gw = Gateway(tiny_tokenizer, verifiers=(v.address,))
    try:
        reply = gw.http.post("/v1/chat/completions", json=GUIDELLM_BODY)
        assert reply.status_code == 200, reply.text
        events = _events(reply)
        with_text = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
        final = events[-1]["usage"]  # include_usage: the last chunk, choices empty
        assert with_text and all("usage" in e for e in with_text)
        counts = [e["usage"]["completion_tokens"] for e in with_text]
        assert counts == sorted(counts) and counts[-1] <= final["completion_tokens"]
        assert {e["usage"]["prompt_tokens"] for e in with_text} == {final["prompt_tokens"]}
        assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
                   for e in with_text)
        assert v.requests[-1].speculation.strategy == common_pb2.DRAFT_STRATEGY_NONE  # the extra body field
        plain = _events(gw.http.post("/v1/chat/completions", json={**GUIDELLM_BODY, "stream_options": {}}))
        assert not any("usage" in e for e in plain)  # only when asked
    finally:
        gw.close()
        v.stop()


def test_lm_evals_request_with_an_empty_bearer_token(tiny_tokenizer):
    v = FakeVerifier("va", tiny_tokenizer)
    gw = Gateway(tiny_tokenizer, verifiers=(v.address,))
    try:
        import requests  # what lm-eval sends with (httpx refuses the header's trailing space)

        reply = requests.post(f"{gw.url}/v1/chat/completions", json=LM_EVAL_BODY, headers={"Authorization": "Bearer "},
                              timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
    finally:
        gw.close()
        v.stop()


def test_the_gateways_default_strategy_serves_requests_that_set_none(tiny_tokenizer):
    """`tandem gateway --speculation none`: a request without `speculation` decodes plainly; one
    that asks for a strategy still gets it."""
    v = FakeVerifier("va", tiny_tokenizer)
    gw = Gateway(tiny_tokenizer, verifiers=(v.address,),
                 default_speculation=SpecConfig(strategy=DraftStrategy.none, max_draft_tokens=8))
    try:
        assert gw.http.post("/v1/chat/completions", json=LM_EVAL_BODY).status_code == 200
        assert v.requests[-1].speculation.strategy == common_pb2.DRAFT_STRATEGY_NONE
        asked = {**LM_EVAL_BODY, "speculation": {"strategy": "ngram"}}
        assert gw.http.post("/v1/chat/completions", json=asked).status_code == 200
        assert v.requests[-1].speculation.strategy == common_pb2.DRAFT_STRATEGY_NGRAM
    finally:
        gw.close()
        v.stop()
