"""The gateway's OpenAPI document (served at GET /openapi.json): what a client, a generator of client
code, or a fuzzer may rely on.

FastAPI derives the paths from the routes, but the request bodies it cannot see: the handlers read
the body themselves (to refuse an oversized one while it streams in, before any parsing), so the
bodies are taken here from the same pydantic models that parse them, and the responses are written
out as the handlers build them. tests/services/test_fuzz_openapi.py runs schemathesis from this
document against a live gateway, which also checks that the document and the server agree.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tandem.contract.params import SamplingParams, SpecConfig
from tandem.services.gateway import errors

# The headers the generation routes read (http.py, which builds the app, names them).
SESSION_HEADER = "X-Session-Id"
# The client's deadline for the whole request, in seconds (as gRPC's deadline does over gRPC): past
# it the request ends with 504 (or an SSE error event) and its verifier frees the request's state.
TIMEOUT_HEADER = "X-Request-Timeout"

# Every 4xx/5xx answer, in OpenAI's shape; the message is bounded (errors.MAX_MESSAGE_CHARS).
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "code"],
        "properties": {
            "message": {"type": "string", "maxLength": errors.MAX_MESSAGE_CHARS},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": "integer"},
        },
    }},
}

_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", "content_filter", None]}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
}
_TANDEM = {
    "type": "object",
    "required": ["verifier_id", "routing"],
    "properties": {"verifier_id": {"type": "string"}, "routing": {"type": "string"},
                   "matched_tokens": {"type": "integer"}, "session_id": {"type": ["string", "null"]},
                   "resumed": {"type": "integer"}},
}


def _completion(obj: str, choice: dict) -> dict:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                       "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                       "usage": _USAGE, "tandem": _TANDEM},
    }


CHAT_COMPLETION = _completion("chat.completion", {
    "type": "object",
    "required": ["index", "message", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH,
                   "message": {"type": "object", "required": ["role"],
                               "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                                              "tool_calls": {"type": "array"}}}},
})
TEXT_COMPLETION = _completion("text_completion", {
    "type": "object",
    "required": ["index", "text", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH},
})
MODEL_LIST = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object", "max_context_tokens"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                       "max_context_tokens": {"type": "integer"}, "verifier_count": {"type": "integer"},
                       "speculation_strategies": {"type": "array", "items": {"type": "string"}},
                       "precision": {"type": "string"}},
    }}},
}
SESSION = {
    "type": "object",
    "required": ["id", "tokens", "verifier_id", "idle_s"],
    "properties": {"id": {"type": "string"}, "tokens": {"type": "integer"}, "verifier_id": {"type": ["string", "null"]},
                   "idle_s": {"type": "number"}},
}
SESSION_DELETED = {"type": "object", "required": ["id", "deleted"],
                   "properties": {"id": {"type": "string"}, "deleted": {"const": True}}}
HEALTH = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}

# One server-sent event of a stream: `data:` a chunk's JSON, a last error object, or [DONE].
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}

_WHY = {
    400: "the request is malformed or asks for what this server does not do (the message says which)",
    401: "no API key, or a wrong one",
    404: "no such session (of this tenant)",
    409: "the session already has a request in flight",
    413: "the body exceeds the gateway's max_body_bytes",
    415: "the body is not application/json",
    429: "overloaded, or over the tenant's limits (see Retry-After)",
    502: "a verifier failed mid-generation",
    503: "no verifier for the model, or the gateway is draining (see Retry-After)",
    504: "the request's deadline passed (X-Request-Timeout)",
}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    return {str(c): _json({"$ref": "#/components/schemas/Error"}, _WHY[c]) for c in codes}


def _generation(body: str, answer: dict, *, auth: bool) -> dict:
    return {
        "parameters": [
            {"name": SESSION_HEADER, "in": "header", "required": False,
             "schema": {"type": "string", "minLength": 1, "maxLength": 256},
             "description": "the conversation this turn belongs to (routes it to the verifier holding its KV cache)"},
            {"name": TIMEOUT_HEADER, "in": "header", "required": False,
             "schema": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e7},
             "description": "the request's deadline in seconds"},
        ],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}}},
        "responses": {
            "200": {"description": "the completion; with \"stream\": true, server-sent events of its chunks",
                    "content": {"application/json": {"schema": answer}, "text/event-stream": {"schema": _EVENT}}},
            **_errors(400, *((401,) if auth else ()), 404, 409, 413, 415, 429, 502, 503, 504),
        },
    }


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _bounds(model: type[BaseModel], **renamed: str) -> dict[str, dict]:
    """The numeric bounds `model` validates its fields with, by field name (or by the body's name for
    it in `renamed`): the request bodies take them from the parameters they become, spelled once."""
    out = {}
    for name, prop in model.model_json_schema()["properties"].items():
        for branch in (prop, *prop.get("anyOf", ())):  # an optional field's bounds sit in its branch
            if any(k in branch for k in _BOUNDS):
                out[renamed.get(name, name)] = {k: branch[k] for k in _BOUNDS if k in branch}
    return out


# What the gateway checks beyond a body model's types (core.py, http.py, tool_calls.py), so that the
# document forbids exactly what the server refuses. JSON Schema keywords apply to their own type
# only (minLength to a string, minItems to an array), so they sit beside a field's anyOf.
_COMMON_RULES = {
    **_bounds(SamplingParams, max_new_tokens="max_tokens"),
    "session_id": {"minLength": 1, "maxLength": 256, "description": "1 to 256 printable characters"},
    "stop": {"maxItems": 8, "minLength": 1, "maxLength": 256, "items": {"type": "string", "minLength": 1, "maxLength": 256}},
    "n": {"minimum": 1, "maximum": 8},
    "logit_bias": {"propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties": 1024},
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {"type": {"const": "function"}, "function": {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}, "description": {"type": "string"},
                       "parameters": {"type": ["object", "null"], "description": "a JSON schema of the arguments"}},
    }},
}
_TOOL_CHOICE = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"],
     "properties": {"type": {"const": "function"},
                    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
    {"type": "null"},
]}
_RULES = {
    "ChatCompletionBody": {**_COMMON_RULES, "messages": {"minItems": 1},
                           "max_completion_tokens": _COMMON_RULES["max_tokens"],
                           "top_logprobs": _bounds(SamplingParams)["top_logprobs"],
                           "tools": {"items": _TOOL}, "tool_choice": _TOOL_CHOICE},
    "CompletionBody": {**_COMMON_RULES, "logprobs": {"minimum": 0, "maximum": 5}},  # prompt: _served
    "ChatMessageIn": {"role": {"minLength": 1}},
    "SpeculationOptions": {**_bounds(SpecConfig)},
}
# Rules between fields, on the whole object.
_OBJECT_RULES = {
    "ResponseFormat": {"if": {"properties": {"type": {"const": "json_schema"}}},
                       "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}},
    "ChatCompletionBody": {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
                           "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
}


def _served(max_tokens: int, vocab_size: int) -> dict[str, dict]:
    """The limits of this gateway and its model, for the fields they bound."""
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    tokens = {"max_tokens": {"maximum": max_tokens}, "stop_token_ids": {"items": token}}
    return {
        "ChatCompletionBody": {**tokens, "max_completion_tokens": {"maximum": max_tokens}},
        "CompletionBody": {**tokens, "prompt": {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": token, "minItems": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        ]}},
    }


def _constrain(schemas: dict, *layers: dict[str, dict]) -> None:
    for name, rules in _merged(_RULES, *layers).items():
        props = schemas[name]["properties"]
        for field, rule in rules.items():
            if field in props:
                props[field].update(rule)
    for name, rule in _OBJECT_RULES.items():
        schemas[name].update(rule)


def _merged(*layers: dict[str, dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for layer in layers:
        for name, rules in layer.items():
            for field, rule in rules.items():
                out.setdefault(name, {}).setdefault(field, {}).update(rule)
    return out


def openapi_document(app: FastAPI, chat: type[BaseModel], completion: type[BaseModel], *, auth: bool,
                     max_tokens: int, vocab_size: int) -> dict:
    """The document for this gateway's `app`, whose generation routes parse `chat` and `completion`
    bodies; `auth`: whether its /v1 routes need an API key; `max_tokens`: the gateway's cap on a
    completion (an API key may set a lower one); `vocab_size`: its model's (token ids lie below)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="Tandem's OpenAI-compatible API (docs/api.md).")
    schemas: dict = {"Error": ERROR}
    for name, model in (("ChatCompletionBody", chat), ("CompletionBody", completion)):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema
    _constrain(schemas, _served(max_tokens, vocab_size))
    doc.setdefault("components", {})["schemas"] = schemas
    v1 = {"401": _errors(401)["401"]} if auth else {}
    ops = {
        ("/v1/chat/completions", "post"): _generation("ChatCompletionBody", CHAT_COMPLETION, auth=auth),
        ("/v1/completions", "post"): _generation("CompletionBody", TEXT_COMPLETION, auth=auth),
        ("/v1/models", "get"): {"responses": {"200": _json(MODEL_LIST, "the served model"), **v1}},
        ("/v1/sessions/{session_id}", "get"): {"responses": {"200": _json(SESSION, "the session"), **v1, **_errors(404)}},
        ("/v1/sessions/{session_id}", "delete"): {"responses": {"200": _json(SESSION_DELETED, "forgotten"), **v1,
                                                                **_errors(404)}},
        ("/health", "get"): {"responses": {"200": _json(HEALTH, "ready"), "503": _json(HEALTH, "not ready, or draining")}},
        ("/healthz", "get"): {"responses": {"200": _json(HEALTH, "alive")}},
        ("/metrics", "get"): {"responses": {"200": {"description": "Prometheus metrics",
                                                    "content": {"text/plain": {"schema": {"type": "string"}}}}}},
    }
    for (path, method), spec in ops.items():
        op = doc["paths"].get(path, {}).get(method)
        if op is None:  # /metrics lives on its own port when metrics_port is set
            continue
        op.pop("requestBody", None)
        # FastAPI's generated 200 (an empty schema) and 422 (a validation shape we never send) go.
        op["responses"] = spec["responses"]
        op["parameters"] = [p for p in op.get("parameters", []) if p["in"] == "path"] + spec.get("parameters", [])
        if "requestBody" in spec:
            op["requestBody"] = spec["requestBody"]
        if auth and path.startswith("/v1/"):
            op["security"] = [{"apiKey": []}]
    if auth:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    return doc
