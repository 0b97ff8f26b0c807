"""schemathesis against the gateway's own OpenAPI document (GET /openapi.json), every route, over real
sockets: once on a gateway without API keys and once on one with them.

schemathesis generates requests from the document, valid ones and (negative mode) ones the
document forbids, and checks each answer: never a 5xx, a status and a content type the document
declares, a body that matches the declared schema (so every error is OpenAI's shape with a bounded
message), anything the document forbids refused with a 4xx, and, with keys, every /v1 route
refusing the same request without its key or with a wrong one. test_fuzz_http.py adds the
attacker-shaped bodies the document cannot describe (raw bytes, deep nesting, odd headers).

Derandomized and bounded in the suite; `make fuzz` runs it at a multiple, from random seeds."""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance, ignored_auth, negative_data_rejection, not_a_server_error, response_schema_conformance,
    status_code_conformance,
)

from fuzzing import fuzz_settings
from test_gateway import FakeVerifier, Gateway

KEY = "sk-fuzz-tenant-0123456789abcdef"
FUZZ = fuzz_settings(40, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much)


def no_server_fault(ctx, response, case):
    """schemathesis' not_a_server_error, less the one 5xx a valid request may earn: 504 when it set
    its own deadline (X-Request-Timeout) below the time it needed."""
    if response.status_code == 504 and "X-Request-Timeout" in (case.headers or {}):
        return True
    return not_a_server_error(ctx, response, case)


CHECKS = [no_server_fault, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
OPERATIONS = [("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET"),
              ("/v1/sessions/{session_id}", "GET"), ("/v1/sessions/{session_id}", "DELETE"), ("/health", "GET"),
              ("/healthz", "GET"), ("/metrics", "GET")]
SEEN: dict[tuple[bool, str, str], set[int]] = {}  # (keys?, path, method) -> statuses answered


@pytest.fixture(scope="module", params=[False, True], ids=["open", "keys"])
def served(request, tiny_tokenizer, tmp_path_factory):
    verifier = FakeVerifier("vf", tiny_tokenizer)
    settings = {"verifiers": (verifier.address,), "max_body_bytes": 64 * 1024}
    if request.param:
        keys = tmp_path_factory.mktemp("keys") / "keys.json"
        keys.write_text(json.dumps({"tenants": {"fuzz": {"keys": [KEY]}}}))
        keys.chmod(0o600)
        settings["api_keys_file"] = str(keys)
    gw = Gateway(tiny_tokenizer, **settings)
    document = gw.http.get("/openapi.json").json()  # the document the gateway itself serves
    schema = schemathesis.openapi.from_dict(document)
    yield request.param, gw, schema
    gw.close()
    verifier.stop()


def test_the_document_names_every_route_and_its_bodies(served):
    keys, gw, schema = served
    document = gw.http.get("/openapi.json").json()
    assert {(p, m.upper()) for p, ops in document["paths"].items() for m in ops} == set(OPERATIONS)
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionBody"}
    assert "messages" in document["components"]["schemas"]["ChatCompletionBody"]["required"]
    assert ("security" in chat) == keys and ("401" in chat["responses"]) == keys
    assert "security" not in document["paths"]["/health"]["get"]  # probes answer without a key


# Negative cases exist only where there is something to get wrong: the bodies (every other input
# is a string the document does not constrain).
CASES = [(p, m, GenerationMode.POSITIVE) for p, m in OPERATIONS] + [
    (p, m, GenerationMode.NEGATIVE) for p, m in OPERATIONS if m == "POST"]


@pytest.mark.parametrize("path,method,mode", CASES, ids=[f"{m}-{p}-{g.value}" for p, m, g in CASES])
def test_schemathesis(served, path, method, mode):
    keys, gw, schema = served
    operation = schema[path][method]
    headers = {"Authorization": f"Bearer {KEY}"} if keys else {}
    checks = CHECKS + ([ignored_auth] if keys and path.startswith("/v1/") else [])

    @FUZZ
    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    def run(case, data):
        # Our key, unless a negative case made its own (malformed) Authorization: that one must be
        # refused, so it is sent as generated.
        sent = {} if mode == GenerationMode.NEGATIVE and "Authorization" in (case.headers or {}) else headers
        response = case.call(base_url=gw.url, headers=sent, timeout=20)
        SEEN.setdefault((keys, path, method), set()).add(response.status_code)
        case.validate_response(response, checks=checks, headers=sent)

    run()


def test_the_fuzz_reached_generation_and_refusals(served, tiny_tokenizer):
    keys, gw, _ = served
    if not SEEN:
        pytest.skip("run with the schemathesis tests")
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert {200, 400} <= SEEN[(keys, path, "POST")], (path, SEEN[(keys, path, "POST")])
    assert 404 in SEEN[(keys, "/v1/sessions/{session_id}", "GET")]
    health = gw.http.get("/health").json()
    assert health["status"] == "ok" and health["requests_in_flight"] == 0
