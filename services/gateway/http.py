"""The gateway's OpenAI-compatible HTTP API (FastAPI), a thin layer over GatewayCore.

    POST   /v1/chat/completions   chat; "stream": true answers with server-sent events
    POST   /v1/completions        raw prompt (text or token ids), no chat template
    GET    /v1/models             the served model, its context window, live verifiers, strategies
    GET    /v1/sessions/{id}      a session's history length and verifier; DELETE forgets it
    GET    /health                readiness: 200 while a verifier of the model is live, else 503
                                  (also 503, status "draining", once SIGTERM arrived)
    GET    /healthz               liveness: 200 while the process serves HTTP
    GET    /metrics               Prometheus metrics of this gateway (tandem.serving.metrics); not
                                  here when the gateway serves them on their own port (metrics_port)

Who may call: with an API key file (services/gateway/auth.py) every /v1 route needs
`Authorization: Bearer KEY` (401 otherwise); the key's tenant owns the sessions it creates and
its caches (docs/security.md). /health, /healthz and /metrics answer without a key: they carry no
prompt or output. Bodies must be `application/json` (415) of at most `max_body_bytes` (413).

Tandem's extensions and choices (everything else as in OpenAI's API reference):

- Session: header `X-Session-Id` or body field `session_id` (if both are given they must agree). A
  session ties a conversation's turns together: they are routed to the verifier that holds its KV
  cache. OpenAI's `user` is accepted and ignored: it names an end user, who may run several
  conversations at once, so it cannot stand for one.
- Deadline: header `X-Request-Timeout: SECONDS` (gRPC: the call's deadline). Past it the request
  ends with 504 (streams: an SSE error event) and the verifier frees its state; without it the
  gateway's request_timeout_s applies.
- Failover: a verifier that dies or shuts down mid-stream is replaced by another from the tokens
  already streamed; the client sees one stream (the response's `tandem.resumed` counts such handovers).
- Shutdown: after SIGTERM new requests get 503 (Retry-After); a stream still running when the
  drain grace ends gets an SSE error event of type service_unavailable_error, never a silent end.
- `speculation`: {"strategy": "none" | "ngram" | "suffix" | "model" | "hybrid", "max_draft_tokens": 1..64,
  "adaptive": bool}, each optional (the gateway's defaults fill the rest). It changes speed, never
  the output.
- `top_k`, `stop_token_ids`, `ignore_eos`: as in tandem.v1.SamplingParams. `temperature` defaults to
  0 (greedy, deterministic), not OpenAI's 1. `max_completion_tokens` and `max_tokens` are synonyms.
- `presence_penalty`, `frequency_penalty`, `logit_bias` (OpenAI's), and the extensions
  `repetition_penalty` and `min_p`: applied by the verifier at every position, drafted or not, so
  speculation leaves the output as plain decoding would make it (tandem.engine.speculation.sampling).
- `stop` strings (up to 8): the verifier stops at the token whose text completes one (matched across
  token boundaries, the same token with speculation as without); the text ends before the string.
- `logprobs` (chat: `logprobs` + `top_logprobs` up to 20; completions: `logprobs` up to 5): each
  generated token's log-probability under the target's raw logits, with the most probable
  alternatives, from the verification forward of its position.
- Structured output: `response_format` `{"type": "json_object"}` or `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (always strict), or Tandem's `grammar`:
  `{"type": "regex" | "ebnf", "value": ...}`. The verifier masks the target to the grammar at every
  position, drafted or not (tandem.engine.speculation.grammar): output as constrained plain decoding makes it.
- `n` (up to 8, streamed or not): the prompt is prefilled once and the choices copy its KV on one
  verifier; a seeded request gives choice i the seed + i. Streamed, the choices' chunks interleave
  (each carries its `index`), and `stream_options.include_usage` sends one usage chunk for all.
- `tools`, `tool_choice` (auto / none / required / a named function), `parallel_tool_calls`
  (services/gateway/tool_calls.py), parsed in the model family's dialect: calls in `message.tool_calls`,
  finish_reason "tool_calls"; a stream sends text as content up to where a call may begin, holds
  the rest, and sends `delta.tool_calls` when the calls are complete.
- Refused with 400 and a message saying so, rather than silently ignored: any other field this
  server does not know (`functions`, ...).
- `usage` adds `prompt_tokens_details.cached_tokens` (prompt tokens whose KV was reused) and
  `speculation` {drafted, accepted, recovered, bonus, steps, mean_accepted_len, acceptance_rate,
  plain_steps, fallback_steps, rejected_blocks}. Streams send it in a last chunk when
  `stream_options.include_usage` is true, as OpenAI does; with vLLM's
  `stream_options.continuous_usage_stats` (load generators such as guidellm send it) every chunk
  also carries the usage so far (prompt, completion and total tokens).
- A request without `speculation` gets the gateway's default (`tandem gateway --speculation`,
  ngram unless set), for clients that cannot add a field (lm-eval).
- Responses (and the last chunk of a stream) carry `tandem`: {verifier_id, routing ("session" |
  "prefix" | "load" | "redis-unavailable"), matched_tokens, session_id}.
- Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 bad request, 401
  no or a wrong API key, 404 unknown session or path, 409 the session already has a request in
  flight, 413 body too large, 415 not JSON, 429 overloaded or the tenant's limits (with
  Retry-After), 502 a verifier failed mid-generation, 503 no verifier, 504 deadline. Messages quote
  at most a short cut of the input and never an internal address. Once a stream has started, a failure arrives as a last event
  `data: {"error": {...}}` and the stream ends without `data: [DONE]`: a completion is never
  silently cut short.
- A client that disconnects cancels the upstream verifier call (streaming or not).
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.contract.params import Grammar
from tandem.services.gateway import errors
from tandem.services.gateway import tool_calls
from tandem.services.gateway.auth import Tenant
from tandem.services.gateway.core import Chunk, GatewayCore, GenerationRequest, clip
from tandem.services.gateway.openapi import SESSION_HEADER, TIMEOUT_HEADER, openapi_document
from tandem.serving.logs import session_id_var
from tandem.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tandem.serving.telemetry import instrument_http_app

_HTTP: dict[type[errors.GatewayError], tuple[int, str]] = {
    errors.InvalidRequest: (400, "invalid_request_error"),
    errors.Unauthenticated: (401, "authentication_error"),
    errors.SessionConflict: (409, "conflict_error"),
    errors.PayloadTooLarge: (413, "invalid_request_error"),
    errors.UnsupportedMediaType: (415, "invalid_request_error"),
    errors.UnknownSession: (404, "not_found_error"),
    errors.Overloaded: (429, "overloaded_error"),
    errors.UpstreamFailed: (502, "upstream_error"),
    errors.NoVerifierAvailable: (503, "service_unavailable_error"),
    errors.DeadlineExceeded: (504, "timeout_error"),
    errors.ShuttingDown: (503, "service_unavailable_error"),
}

T = TypeVar("T")


def http_status(exc: errors.GatewayError) -> tuple[int, str]:
    for cls in type(exc).__mro__:
        if cls in _HTTP:
            return _HTTP[cls]
    return 500, "server_error"


def _error_body(message: str, kind: str, status: int) -> dict:
    return {"error": {"message": errors.bounded(message), "type": kind, "param": None, "code": status}}


RETRY_AFTER_S = 1  # a full verifier frees KV within seconds: sessions finish, idle ones are evicted
MAX_JSON_DEPTH = 32  # a chat request nests 5 deep; deeper is a parser attack, not a request


def error_response(exc: errors.GatewayError) -> JSONResponse:
    status, kind = http_status(exc)
    headers = None
    if status in (429, 503):
        headers = {"Retry-After": str(max(1, math.ceil(getattr(exc, "retry_after_s", RETRY_AFTER_S))))}
    elif status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(_error_body(str(exc), kind, status), status_code=status, headers=headers)


# -- request bodies -------------------------------------------------------------------------


class _Strict(BaseModel):
    # Unknown fields refused, and no coercion: "stream": 0 or "n": "2" is a client's mistake to hear
    # of, not to have guessed (the OpenAPI document states the types; the fuzzer holds us to them).
    model_config = ConfigDict(extra="forbid", strict=True)


class SpeculationOptions(_Strict):
    strategy: Literal["none", "ngram", "suffix", "model", "hybrid"] | None = None
    max_draft_tokens: int | None = None
    adaptive: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # description and other annotations: accepted, unused

    name: str = Field("response", max_length=64)
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GrammarOption(_Strict):
    """Tandem's extension: a regular expression or an EBNF (GBNF) grammar the output must match."""

    type: Literal["regex", "ebnf"]
    value: str


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's extension, sent by load generators (guidellm) to count tokens per chunk: every chunk
    # carries the usage so far.
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id) go to the chat template as they are.
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        extra = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        return {**extra, "role": self.role, "content": content or ""}


class _CommonBody(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted, ignored (see the module docstring)
    # Tandem's extensions
    session_id: str | None = None
    speculation: SpeculationOptions | None = None
    top_k: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a string) -> bias in [-100, 100]
    repetition_penalty: float | None = None
    min_p: float | None = None
    response_format: ResponseFormat | None = None
    grammar: GrammarOption | None = None  # Tandem's extension

    def grammar_constraint(self, plan: "tool_calls.ToolPlan" = tool_calls.NO_TOOLS) -> Grammar | None:
        rf = self.response_format
        if plan.mode == "required":
            if (rf is not None and rf.type != "text") or self.grammar is not None:
                raise errors.InvalidRequest("a required tool call is its own grammar: drop response_format / grammar")
            return tool_calls.call_grammar(list(plan.fns), plan.dialect)
        if rf is not None and rf.type != "text" and self.grammar is not None:
            raise errors.InvalidRequest("give response_format or grammar, not both")
        if self.grammar is not None:
            return Grammar(kind=self.grammar.type, value=self.grammar.value)
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return Grammar(kind="json_object")
        if rf.json_schema is None:
            raise errors.InvalidRequest("response_format json_schema needs its json_schema object")
        return Grammar(kind="json_schema", value=json.dumps(rf.json_schema.schema_, sort_keys=True))

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise errors.InvalidRequest(f"logit_bias keys are token ids, got {key[:20]!r}")
            pairs.append((int(key), bias))
        return tuple(sorted(pairs))


class ChatCompletionBody(_CommonBody):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: the first call the model writes, no more

    def tool_plan(self, support: "tool_calls.ToolSupport") -> "tool_calls.ToolPlan":
        """What this request may call and how its calls are parsed, for the gateway's model."""
        if not self.tools and self.tool_choice in (None, "none", "auto"):
            return tool_calls.NO_TOOLS
        fns, mode = tool_calls.chosen(self.tools or [], self.tool_choice)
        return tool_calls.ToolPlan(tuple(fns), mode, support.dialect, self.parallel_tool_calls is not False)

    def logprob_count(self) -> int | None:
        """OpenAI's chat form: logprobs true, with top_logprobs alternatives (0 to 20)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise errors.InvalidRequest("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(_CommonBody):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None

    def logprob_count(self) -> int | None:
        """The completions form: logprobs = how many alternatives (0 to 5)."""
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise errors.InvalidRequest(f"logprobs must be 0 to 5 on /v1/completions, got {self.logprobs}")
        return self.logprobs


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            parts.append(f"'{loc}' is not supported by this server")
        else:
            parts.append(f"{loc}: {err['msg']} (got {clip(err.get('input'))})")
    return "; ".join(parts)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit`: from Content-Length before
    reading anything, else while it streams in, so a huge body is never held whole."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise errors.InvalidRequest("the Content-Length header is not a number")
        if int(length) > limit:
            raise errors.PayloadTooLarge(f"the request body is {int(length)} bytes; this gateway accepts at most {limit}")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise errors.PayloadTooLarge(f"the request body exceeds this gateway's limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)


def _too_deep(value: object, limit: int) -> bool:
    """Whether JSON `value` nests deeper than `limit` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


async def _parse(request: Request, model: type[T], max_bytes: int) -> T:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise errors.UnsupportedMediaType(
            f"the request body must be application/json (Content-Type: {clip(media or 'none', 60)})"
        )
    raw = await _read_body(request, max_bytes)
    try:
        data = json.loads(raw)
    except RecursionError:
        raise errors.InvalidRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        # The decoder's message names a position, not the input.
        raise errors.InvalidRequest(f"the request body is not valid JSON: {clip(str(exc), 120)}") from None
    if _too_deep(data, MAX_JSON_DEPTH):
        raise errors.InvalidRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(data, dict):
        raise errors.InvalidRequest("the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        raise errors.InvalidRequest(_describe(exc)) from None
    return body


def _session_id(request: Request, body: _CommonBody) -> str | None:
    header = request.headers.get(SESSION_HEADER)
    if header is not None and body.session_id is not None and header != body.session_id:
        raise errors.InvalidRequest(f"the {SESSION_HEADER} header and the session_id field disagree")
    sid = header if header is not None else body.session_id
    if sid is not None and not (0 < len(sid) <= 256 and sid.isprintable()):
        raise errors.InvalidRequest("a session id must be 1 to 256 printable characters")
    return sid


def _timeout(request: Request) -> float | None:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < 1e7:  # also refuses nan and inf
        raise errors.InvalidRequest(f"the {TIMEOUT_HEADER} header is a number of seconds above 0, got {clip(value, 40)}")
    return seconds


def _domain_request(request: Request, body: _CommonBody, tenant: Tenant, *,
                    plan: "tool_calls.ToolPlan" = tool_calls.NO_TOOLS, **input_fields) -> GenerationRequest:
    max_tokens = body.max_tokens
    extra_max = getattr(body, "max_completion_tokens", None)
    if extra_max is not None:
        if max_tokens is not None and max_tokens != extra_max:
            raise errors.InvalidRequest("max_tokens and max_completion_tokens disagree; give one")
        max_tokens = extra_max
    spec = body.speculation or SpeculationOptions()
    return GenerationRequest(
        session_id=_session_id(request, body),
        model=body.model,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        max_tokens=max_tokens,
        stop_token_ids=tuple(body.stop_token_ids),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.bias_pairs(),
        min_p=body.min_p,
        stop=body.stop_strings(),
        top_logprobs=body.logprob_count(),
        grammar=body.grammar_constraint(plan),
        tool_functions=plan.fns,
        strategy=spec.strategy,
        max_draft_tokens=spec.max_draft_tokens,
        adaptive=spec.adaptive,
        timeout_s=_timeout(request),
        tenant=tenant,
        **input_fields,
    )


# -- responses ------------------------------------------------------------------------------


def usage_dict(chunk: Chunk) -> dict:
    u, s = chunk.usage, chunk.stats
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "speculation": {
            "drafted": s.drafted,
            "accepted": s.accepted,
            "recovered": s.recovered,
            "bonus": s.bonus,
            "steps": s.steps,
            "mean_accepted_len": round(s.mean_accepted_len, 4),
            "acceptance_rate": round(s.accepted / s.drafted, 4) if s.drafted else 0.0,
            "plain_steps": s.plain_steps,
            "fallback_steps": s.fallback_steps,
            "rejected_blocks": s.rejected_blocks,
        },
    }


def tandem_dict(chunk: Chunk, session_id: str | None) -> dict:
    r = chunk.routing
    return {"verifier_id": chunk.verifier_id, "routing": r.reason, "matched_tokens": r.matched_tokens,
            "session_id": session_id, "resumed": chunk.resumed}


class _Format:
    """OpenAI's shapes for one endpoint: chat.completion(.chunk) or text_completion."""

    def __init__(self, chat: bool, model: str, session_id: str | None, include_usage: bool, tokenizer=None,
                 tools: "tool_calls.ToolPlan" = tool_calls.NO_TOOLS):
        self.chat, self.model, self.session_id, self.include_usage = chat, model, session_id, include_usage
        self.tools = tools  # with tools, the text is parsed for calls
        self._text: list[str] = []  # a stream's text so far (with tools)
        self._sent = 0  # characters of it sent as content (with tools: those no call can begin in)
        self.continuous_usage = False  # stream_options.continuous_usage_stats: usage on every chunk
        self._completion = 0  # tokens streamed so far (for continuous usage)
        self.tokenizer = tokenizer  # for the text of tokens in logprobs
        self.offset = 0  # characters of text before the next chunk (completions' text_offset)
        self._before: list[int] = []  # tokens whose logprobs were formatted (the context of the next)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.tool_format: str | None = None  # with tools: how they were rendered and parsed (ToolSupport.label)

    def sibling(self) -> "_Format":
        """A formatter for another choice of the same response: the same settings and id, its own
        text, logprob and tool state."""
        other = copy.copy(self)
        other._text, other._sent, other._before, other.offset, other._completion = [], 0, [], 0, 0
        return other

    def _tandem(self, chunk: Chunk) -> dict:
        extra = {"tool_format": self.tool_format} if self.tool_format else {}
        return {**tandem_dict(chunk, self.session_id), **extra}

    def _envelope(self, choices: list, *, stream: bool, **extra) -> dict:
        obj = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _pieces(self, ids: list[int]) -> list[str]:
        """The text each of `ids` adds after the tokens formatted so far (a few of them as context,
        so a tokenizer's word-initial spaces come out right): chosen tokens' pieces concatenate to
        the completion's text."""
        window = self._before[-4:]
        base = self.tokenizer.decode(window, skip_special_tokens=True)
        return [self.tokenizer.decode(window + [i], skip_special_tokens=True)[len(base):] for i in ids]

    def _logprobs(self, items, text: str) -> dict | None:
        """OpenAI's logprobs object for these tokens: chat's {"content": [...]}, or completions'
        {"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""
        if items is None:
            return None
        rows = []  # per token: (its text, [(alternative's text, logprob)])
        for t in items:
            pieces = self._pieces([t.token, *(i for i, _ in t.top)])
            rows.append((pieces[0], list(zip(pieces[1:], (lp for _, lp in t.top)))))
            self._before.append(t.token)
        if self.chat:
            def entry(s: str, lp: float) -> dict:
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}

            return {"content": [{**entry(s, t.logprob), "top_logprobs": [entry(a, lp) for a, lp in alts]}
                                for t, (s, alts) in zip(items, rows)], "refusal": None}
        offsets, at = [], self.offset
        for s, _ in rows:
            offsets.append(at)
            at += len(s)
        return {"tokens": [s for s, _ in rows], "token_logprobs": [t.logprob for t in items],
                "top_logprobs": [dict(alts) for _, alts in rows], "text_offset": offsets}

    def _choice(self, text: str | None, finish: str | None, *, stream: bool, role: bool = False,
                logprobs: dict | None = None) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        if stream:
            delta = {"role": "assistant", "content": text or ""} if role else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                "logprobs": logprobs}

    def whole(self, chunks: list[Chunk]) -> dict:
        return self.whole_choices([chunks])

    def whole_choices(self, choices: list[list[Chunk]]) -> dict:
        """The response of one or more complete choices (n > 1): choice i at index i; usage counts
        the prompt once and every choice's completion; speculation and routing are choice 0's."""
        out = []
        for i, chunks in enumerate(choices):
            text = "".join(c.text for c in chunks)
            asked = any(c.logprobs is not None for c in chunks)
            self._before, self.offset = [], 0
            logprobs = self._logprobs([t for c in chunks for t in c.logprobs or ()], text) if asked else None
            choice = self._choice(text, chunks[-1].finish_reason.value, stream=False, logprobs=logprobs)
            if self.tools.mode != "none":
                content, calls = tool_calls.parse(text, self.tools)
                if calls:
                    choice["message"] = {"role": "assistant", "content": content,
                                         "tool_calls": [_call_dict(c) for c in calls]}
                    choice["finish_reason"] = "tool_calls"
            out.append({**choice, "index": i})
        last = choices[0][-1]
        return self._envelope(out, stream=False, usage=choices_usage([c[-1] for c in choices]),
                              tandem=self._tandem(last))

    def events(self, chunk: Chunk, *, first: bool) -> list[dict]:
        self._completion += len(chunk.token_ids)
        out = (self._tool_events(chunk, first=first) if self.chat and self.tools.mode != "none"
               else self._events(chunk, first=first))
        if self.continuous_usage:
            so_far = {"prompt_tokens": chunk.prompt_tokens, "completion_tokens": self._completion,
                      "total_tokens": chunk.prompt_tokens + self._completion}
            for event in out:
                if event["choices"] and "usage" not in event:
                    event["usage"] = so_far
        return out

    def _events(self, chunk: Chunk, *, first: bool) -> list[dict]:
        out = []
        if first and self.chat:
            out.append(self._envelope([self._choice("", None, stream=True, role=True)], stream=True))
        if chunk.text or (chunk.logprobs and chunk.token_ids):
            logprobs = self._logprobs(chunk.logprobs, chunk.text)
            out.append(self._envelope([self._choice(chunk.text, None, stream=True, logprobs=logprobs)], stream=True))
            self.offset += len(chunk.text)
        if chunk.finish_reason is not None:
            out.append(
                self._envelope(
                    [self._choice("", chunk.finish_reason.value, stream=True)], stream=True,
                    tandem=self._tandem(chunk),
                )
            )
            if self.include_usage:
                out.append(self._envelope([], stream=True, usage=usage_dict(chunk)))
        return out


    def _tool_events(self, chunk: Chunk, *, first: bool) -> list[dict]:
        """With tools, text streams as content up to where a call may begin (the dialect says
        where: a `<tool_call>` arriving, a response opening with `{`); the rest is held until the
        end, where the calls are known: then the content left (if any) and `delta.tool_calls` go
        out, and finish_reason tool_calls. A required call is all held (the whole text is it)."""
        out = []
        if first:
            out.append(self._envelope([self._choice("", None, stream=True, role=True)], stream=True))
        self._text.append(chunk.text)
        text = "".join(self._text)
        if chunk.finish_reason is None:
            safe = self.tools.dialect.hold_from(text) if self.tools.mode == "auto" else 0
            if safe > self._sent:
                out.append(self._envelope([self._choice(text[self._sent:safe], None, stream=True)], stream=True))
                self._sent = safe
            return out
        spans, calls = tool_calls.calls_in(text, self.tools)
        content = tool_calls.without(text, spans, self._sent) if calls else text[self._sent:]
        if calls:  # as the whole response's content is: without the space the calls leave
            content = content.rstrip() if self._sent else content.strip()
        if content:
            out.append(self._envelope([self._choice(content, None, stream=True)], stream=True))
        if calls:
            delta = {"tool_calls": [{"index": i, **_call_dict(c)} for i, c in enumerate(calls)]}
            out.append(self._envelope([{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}],
                                      stream=True))
        finish = "tool_calls" if calls else chunk.finish_reason.value
        out.append(self._envelope([self._choice("", finish, stream=True)], stream=True,
                                  tandem=self._tandem(chunk)))
        if self.include_usage:
            out.append(self._envelope([], stream=True, usage=usage_dict(chunk)))
        return out


def choices_usage(lasts: list[Chunk]) -> dict:
    """The usage of n choices from each one's final chunk: the prompt once, every completion."""
    usage = usage_dict(lasts[0])
    completion = sum(c.usage.completion_tokens for c in lasts)
    usage.update(completion_tokens=completion, total_tokens=usage["prompt_tokens"] + completion)
    return usage


def _call_dict(call: "tool_calls.ToolCall") -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so the upstream call) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise _ClientGone


def _holding(response: Response, slot) -> Response:
    """`response`, giving the tenant's request slot back when it ends: now for a whole body, when the
    stream is done or cut for a stream."""
    if not isinstance(response, StreamingResponse):
        slot.release()
        return response
    body = response.body_iterator

    async def held():
        try:
            async for part in body:
                yield part
        finally:
            slot.release()

    response.body_iterator = held()
    return response


async def _respond(request: Request, core: GatewayCore, req: GenerationRequest, body: _CommonBody, chat: bool,
                   tools: "tool_calls.ToolPlan" = tool_calls.NO_TOOLS) -> Response:
    fmt = _Format(chat, core.model_name, req.session_id, bool(body.stream_options and body.stream_options.include_usage),
                  core.tokenizer, tools)
    if tools.fns:
        fmt.tool_format = core.tool_support.label
    fmt.continuous_usage = bool(body.stream_options and body.stream_options.continuous_usage_stats)
    session_id_var.set(req.session_id)  # before the tasks below copy this request's context
    n = 1 if body.n is None else body.n  # 0 or less is refused by generate_choices, not taken as 1
    if body.stream and n != 1:
        return await _stream_choices(request, core, req, n, fmt)
    chunks = core.generate(req)
    if not body.stream and n != 1:
        await chunks.aclose()  # n > 1: the core runs the choices itself
        try:
            return JSONResponse(fmt.whole_choices(await _unless_disconnected(request, core.generate_choices(req, n))))
        except _ClientGone:
            return Response(status_code=499)
    if not body.stream:
        async def collect() -> list[Chunk]:
            async with aclosing(chunks):
                return [c async for c in chunks]

        try:
            return JSONResponse(fmt.whole(await _unless_disconnected(request, collect())))
        except _ClientGone:
            return Response(status_code=499)
    # Wait for the first chunk before answering, so that errors up to then get a real status.
    try:
        first = await _unless_disconnected(request, anext(chunks))
    except _ClientGone:
        return Response(status_code=499)
    except BaseException:
        await chunks.aclose()
        raise

    async def events() -> AsyncIterator[str]:
        async with aclosing(chunks):
            try:
                chunk, is_first = first, True
                while chunk is not None:
                    for event in fmt.events(chunk, first=is_first):
                        yield _sse(event)
                    chunk, is_first = await anext(chunks, None), False
            except errors.GatewayError as exc:
                status, kind = http_status(exc)
                yield _sse(_error_body(str(exc), kind, status))
                return
            yield _sse("[DONE]")

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def _stream_choices(request: Request, core: GatewayCore, req: GenerationRequest, n: int, fmt: "_Format") -> Response:
    """n > 1 streamed: one formatter per choice (each holds its own text, stop and tool state),
    under one response id; each event's choices carry their index; usage once, for all, at the end."""
    fmts = [fmt] + [fmt.sibling() for _ in range(n - 1)]
    items = core.stream_choices(req, n)
    try:  # the warm-up and the first chunk before answering: errors up to then get a real status
        first = await _unless_disconnected(request, anext(items))
    except _ClientGone:
        await items.aclose()
        return Response(status_code=499)
    except BaseException:
        await items.aclose()
        raise

    async def events() -> AsyncIterator[str]:
        started, lasts = [False] * n, [None] * n
        async with aclosing(items):
            item = first
            try:
                while item is not None:
                    i, chunk = item
                    for event in fmts[i].events(chunk, first=not started[i]):
                        if not event["choices"]:  # a choice's own usage chunk: one for all comes last
                            continue
                        for choice in event["choices"]:
                            choice["index"] = i
                        yield _sse(event)
                    started[i], lasts[i] = True, chunk
                    item = await anext(items, None)
            except errors.GatewayError as exc:
                status, kind = http_status(exc)
                yield _sse(_error_body(str(exc), kind, status))
                return
            if fmt.include_usage and all(lasts):
                yield _sse(fmt._envelope([], stream=True, usage=choices_usage(lasts)))
            yield _sse("[DONE]")

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def create_app(core: GatewayCore) -> FastAPI:
    app = FastAPI(title="Tandem gateway", version="v1", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())
    document: dict = {}

    @app.exception_handler(errors.GatewayError)
    async def _gateway_error(request: Request, exc: errors.GatewayError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(_error_body(str(exc.detail), kind, exc.status_code), status_code=exc.status_code)

    max_bytes = core.settings.max_body_bytes

    def tenant_of(request: Request) -> Tenant:
        return core.authenticate(request.headers.get("authorization"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant = tenant_of(request)  # before the body is read: an anonymous caller costs nothing
        slot = core.limiter.enter(tenant)  # and a tenant over its limits nothing more
        try:
            body = await _parse(request, ChatCompletionBody, max_bytes)
            messages = [m.as_template_dict() for m in body.messages]
            plan = body.tool_plan(core.tool_support)
            req = _domain_request(request, body, tenant, plan=plan, messages=messages, slot=slot)
            return _holding(await _respond(request, core, req, body, chat=True, tools=plan), slot)
        except BaseException:
            slot.release()
            raise

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = tenant_of(request)
        slot = core.limiter.enter(tenant)
        try:
            body = await _parse(request, CompletionBody, max_bytes)
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise errors.InvalidRequest("one prompt per request: batch prompts are not supported")
                prompt = prompt[0]
            req = _domain_request(request, body, tenant, prompt=prompt, slot=slot)
            return _holding(await _respond(request, core, req, body, chat=False), slot)
        except BaseException:
            slot.release()
            raise

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        tenant_of(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": card.id,
                    "object": "model",
                    "created": started,
                    "owned_by": "tandem",
                    "max_context_tokens": card.max_context_tokens,
                    "verifier_count": card.verifier_count,
                    "speculation_strategies": [s.value for s in card.strategies],
                    "precision": card.precision,  # what the output is lossless against
                }
                for card in core.list_models()
            ],
        }

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> dict:
        info = core.session(session_id, tenant_of(request))
        return {"id": info.session_id, "tokens": info.tokens, "verifier_id": info.verifier_id, "idle_s": round(info.idle_s, 3)}

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request) -> dict:
        core.forget_session(session_id, tenant_of(request))
        return {"id": session_id, "deleted": True}

    @app.get("/health")
    async def health() -> JSONResponse:
        report = core.health()
        return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    # Public like OpenAI's own: it names routes and fields, nothing of a tenant or a deployment.
    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict:
        if not document:
            document.update(openapi_document(app, ChatCompletionBody, CompletionBody, auth=core.keys is not None,
                                             max_tokens=core.settings.max_tokens_cap, vocab_size=core.vocab_size))
        return document

    if core.settings.metrics_port is None:  # else only on its own port, which need not be public

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(core.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    instrument_http_app(app)
    return app
