"""The gateway's domain: validate and tokenize requests, keep session histories, route each session
to a verifier, stream its committed tokens back as text. Transport-free: server.py (gRPC) and
http.py (OpenAI HTTP) unpack into `GenerationRequest`, iterate `GatewayCore.generate`, and pack the
`Chunk`s; domain errors (errors.py) become status codes there.

One request, end to end:

    context  = chat template(messages) | tokenize(prompt) | the session's history   (token ids)
    verifier = routing policy: session owner > longest resident prefix > least loaded (serving/routing.py)
    drafter  = the session's drafter for its strategy (round-robin when new)
    stream   = Verifier.Generate(session_id, context, sampling, speculation, drafter)
    for each CommittedTokens: check first_index == tokens so far, detokenize, yield a Chunk
    history[session] = context + generated

Invariants the client can rely on: every generated token is yielded exactly once, in order
(first_index is checked); a stream that ends without a finish reason, reports an error, or breaks
raises `UpstreamFailed` (never a silent truncation); a verifier that cannot be reached before
anything streamed is replaced by the next candidate (safe, since the context travels whole).

Failover mid-stream: when a verifier's stream breaks at the transport after tokens went out (the
process died, or it drained at shutdown), the request continues on another verifier with
context + the tokens streamed so far, marked `resumed_tokens` so that penalties, grammar and stop
strings count them as output; the client sees one uninterrupted stream. Greedy output is the
same tokens; sampled output keeps the target's distribution (a seeded request continues with a
seed derived from its seed and the resume point, so it does not reuse the random draws that made
the tokens before it; a replay of a seeded request that failed over is therefore not bit-identical).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import hashlib
import itertools
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from typing import Protocol, get_args
from contextlib import aclosing
from dataclasses import dataclass, field

from opentelemetry import trace
import jinja2
from pydantic import ValidationError

from tandem.contract.params import DraftStrategy, Grammar, SamplingParams, SpecConfig
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.services.gateway import tool_calls
from tandem.services.gateway.auth import OPEN, KeyringFile, Tenant, TenantLimiter, bearer_key
from tandem.serving.logs import log_prompts_enabled, session_id_var
from tandem.serving.messages import CommittedTokens, DrafterInfo, VerifierRequest
from tandem.serving.metrics import GatewayMetrics, status_of
from tandem.serving.residency import ResidencyConfig, ResidencyIndex, VerifierRecord
from tandem.serving.routing import RESIDENCY_HITS, RoutingDecision, RoutingReason, make_policy
from tandem.services.gateway.errors import (
    DeadlineExceeded,
    InvalidRequest,
    NoVerifierAvailable,
    Overloaded,
    SessionConflict,
    ShuttingDown,
    StreamCut,
    Unauthenticated,
    UnknownSession,
    UpstreamFailed,
    VerifierBusy,
    VerifierUnreachable,
)
from tandem.contract.ids import common_prefix_len
from tandem.contract.results import FinishReason, SpecStats, TokenLogprob
from tandem.contract.text import Detokenizer
from tandem.services.gateway.fairpool import FairPool
from tandem.services.gateway.settings import GatewaySettings
from tandem.serving.telemetry import tracer

log = logging.getLogger("tandem.gateway")

_DRAIN_S = 1.0  # how long a verifier may take to close its stream after the final message
_REFRESH_GAP_S = 0.25  # on-demand refreshes (a request found no verifier) are at least this far apart



class CommittedStream(Protocol):
    """One Verifier.Generate call as the core reads it: an async iterator of CommittedTokens whose
    failures are the domain errors of errors.py (VerifierUnreachable / VerifierBusy before the
    first message, UpstreamFailed or DeadlineExceeded after)."""

    def __aiter__(self) -> "CommittedStream": ...

    async def __anext__(self) -> CommittedTokens: ...

    def cancel(self) -> None: ...

    def cut(self, reason: str) -> None: ...


class Upstream(Protocol):
    """How the core reaches verifiers and drafters (client.py's `RpcClients` over gRPC)."""

    async def verifier_info(self, address: str, timeout_s: float) -> VerifierRecord | None: ...

    async def drafter_info(self, address: str, timeout_s: float) -> DrafterInfo | None: ...

    def generate(self, address: str, request: VerifierRequest, timeout_s: float | None) -> CommittedStream: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class GenerationRequest:
    """One request as both transports hand it over; None = not given (server default)."""

    session_id: str | None = None  # ties a conversation's turns together; None = one-off
    model: str | None = None  # None or "" = the served model
    prompt: str | list[int] | None = None  # raw text (tokenized without a template) or token ids
    messages: list[dict] | None = None  # a chat, rendered with the model's template
    # Neither prompt nor messages: continue the session from its history (e.g. after "length").
    temperature: float | None = None  # default 0 = greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    top_logprobs: int | None = None  # logprobs with this many alternatives; None = none
    grammar: Grammar | None = None  # structured output (response_format, or a regex / EBNF)
    # Tools the model may call (services/gateway/tool_calls.py), already checked; rendered into the prompt.
    tool_functions: tuple = ()
    # Internal (n > 1): route to this verifier, which holds the prompt's KV from a warm-up turn.
    prefer_verifier: str | None = None
    strategy: str | None = None  # a DraftStrategy value; None = the gateway's default_speculation
    max_draft_tokens: int | None = None
    adaptive: bool | None = None
    timeout_s: float | None = None  # the client's deadline, if shorter than the gateway's
    tenant: Tenant = OPEN  # who asked (GatewayCore.authenticate): owns the session and its caches
    # The tenant's request slot the transport took at intake (TenantLimiter.enter) and releases when
    # the response ends; None: the core takes one at admission.
    slot: object = None


# How long a full verifier may queue a request while the gateway has another verifier to try.
HOP_ADMISSION_WAIT_S = 2.0

# GenerationRequest's fields that are SamplingParams' own, under the same names (max_tokens is the
# request's cap, checked against the context window before it becomes max_new_tokens).
REQUEST_SAMPLING = tuple(name for name in SamplingParams.model_fields if name != "max_new_tokens")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int  # the tokens streamed (the stop token that ended the reply is not one)
    cached_prompt_tokens: int  # prompt tokens whose KV the verifier reused

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Chunk:
    """A piece of a generation. Concatenated `text` is the completion (stop tokens left out);
    concatenated `token_ids` are the generated tokens, each once, in order."""

    text: str
    token_ids: tuple[int, ...]
    first_index: int  # output index of token_ids[0]
    verifier_id: str
    finish_reason: FinishReason | None = None  # set on the last chunk only (stop or length)
    usage: Usage | None = None  # last chunk only
    stats: SpecStats | None = None  # last chunk only: the verifier's counters of the request
    routing: RoutingDecision | None = None  # last chunk only: where and why
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token_ids entry, when asked for
    prompt_tokens: int = 0  # the prompt's length, on every chunk (usage so far, for streams that ask)
    resumed: int = 0  # last chunk only: times the stream moved to another verifier mid-way (failover)


@dataclass(frozen=True)
class ModelCard:
    id: str
    is_default: bool
    max_context_tokens: int
    verifier_count: int
    strategies: tuple[DraftStrategy, ...]
    # what the target computes in, as its live verifiers say (ModelInfo.precision); "" = not said
    precision: str = ""


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    tokens: int  # history length: context + generated tokens of its last turn
    verifier_id: str | None
    idle_s: float


@dataclass
class _Session:
    token_ids: list[int]
    verifier_id: str | None = None
    drafters: dict[DraftStrategy, str] = field(default_factory=dict)  # sticky drafter per strategy
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    """Session histories, least recently used dropped beyond `max_sessions` or after `idle_s`."""

    def __init__(self, max_sessions: int, idle_s: float):
        self._max, self._idle_s = max_sessions, idle_s
        self._items: OrderedDict[str, _Session] = OrderedDict()

    def get(self, session_id: str) -> _Session | None:
        item = self._items.get(session_id)
        if item is None:
            return None
        if time.monotonic() - item.last_used > self._idle_s:
            del self._items[session_id]
            return None
        self._items.move_to_end(session_id)
        return item

    def put(self, session_id: str, item: _Session) -> None:
        item.last_used = time.monotonic()
        self._items[session_id] = item
        self._items.move_to_end(session_id)
        while len(self._items) > self._max:
            self._items.popitem(last=False)

    def pop(self, session_id: str) -> _Session | None:
        return self._items.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class GatewayStats:
    """The gateway's counters: /health shows them, the metrics read them at scrape time."""

    requests: int = 0
    # routing reason -> requests; every reason present from the start, so a metrics scrape from
    # another thread never copies the mapping while a new key is being added
    routed: Counter = field(default_factory=lambda: Counter(dict.fromkeys(get_args(RoutingReason), 0)))
    failed: Counter = field(default_factory=Counter)  # error class -> requests
    connect_failures: int = 0  # verifiers found unreachable at connect (then the next one tried)
    resumed: int = 0  # streams cut mid-way and continued on another verifier
    cut_at_shutdown: int = 0  # streams this gateway ended itself at the end of its drain grace


@dataclass(frozen=True)
class _Prepared:
    prefer_verifier: str | None  # GenerationRequest.prefer_verifier
    session_id: str | None  # the client's name for it
    key: str | None  # the session's id inside the system: scoped by tenant (session_key)
    tenant: Tenant
    context_ids: list[int]
    sampling: SamplingParams
    spec: SpecConfig
    timeout_s: float


def session_key(tenant: Tenant, session_id: str) -> str:
    """The id a session has in the gateway's store, on verifiers and in Redis. Tenant names cannot
    contain "/", so two tenants' keys never collide; an open gateway keeps the client's id."""
    return f"{tenant.name}/{session_id}" if tenant.name else session_id


def clip(value: object, limit: int = 80) -> str:
    """repr of a client's value for an error message, cut: errors never echo a whole input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


def max_token_bytes(tokenizer) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token of `tokenizer` stands for, where there is
    one: a BPE model's tokens are its vocabulary entries, whose characters stand for one byte each in
    a byte-level BPE and for up to 4 otherwise (an unknown character is one token). None for other
    models (a word-level one maps a word of any length to <unk>)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if (spec.get("model") or {}).get("type") != "BPE":
        return None
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=4)
    byte_level = '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer")) + json.dumps(spec.get("decoder"))
    return max(16, longest if byte_level else 4 * longest)


def _check_text(text: str, where: str) -> None:
    """Text a tokenizer can take: valid Unicode, so no lone UTF-16 surrogate (JSON's "\\ud800"
    escapes decode to one), said plainly instead of a codec exception from inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{where} holds a lone surrogate (U+{ord(text[exc.start]):04X} at character "
                             f"{exc.start}), which is not Unicode text") from None


def _describe(exc: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors():
        loc = prefix + ".".join(str(p) for p in err["loc"])
        parts.append(f"{loc}: {err['msg']} (got {clip(err.get('input'))})")
    return "; ".join(parts)


class TextCut:
    """The streamed text with stop strings applied: the end that could begin a stop string is held
    back until the next piece shows it does not, and the text ends before the first stop string
    (the verifier stops at the token that completes it; that token's text may run past it)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._keep = max((len(s) for s in stops), default=1) - 1
        self._held = ""
        self._done = False

    def push(self, text: str, *, final: bool) -> str:
        if not self.stops:
            return text
        if self._done:
            return ""
        held = self._held + text
        hits = [i for i in (held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._done, self._held = True, ""
            return held[: min(hits)]
        if final or len(held) <= self._keep:
            self._held = "" if final else held
            return held if final else ""
        self._held = held[len(held) - self._keep:] if self._keep else ""
        return held[: len(held) - self._keep]


class GatewayCore:
    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer,
        *,
        model_id: str,
        max_context_tokens: int,
        clients: Upstream,
        index: ResidencyIndex | None = None,
    ):
        self.settings = settings
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.model_name = settings.served_model_name or model_id
        self._max_context = min(max_context_tokens, settings.max_context_tokens or max_context_tokens)
        self.vocab_size = len(tokenizer)
        self._clients = clients
        # How requests with tools are rendered; said once here and in each such response
        self.tool_support = tool_calls.detect(tokenizer)
        if self.tool_support.renderer == tool_calls.GATEWAY:
            log.warning("the chat template of %s %s: requests with tools %s", self.model_name, self.tool_support.why,
                        "get the gateway's Hermes-style <tool_call> convention (tandem.tool_format: gateway/hermes "
                        "in each response)" if settings.tool_fallback else "are refused (--no-tool-fallback)")
        else:
            log.info("the chat template of %s renders tools; calls are parsed in its family's dialect (%s)",
                     self.model_name, self.tool_support.dialect.name)
        if index is None and settings.redis_url:
            index = ResidencyIndex(
                ResidencyConfig(
                    url=settings.redis_url, block_size=settings.prefix_block_size,
                    socket_timeout_s=settings.redis_timeout_s, ca_file=settings.redis_ca,
                    cert_file=settings.redis_cert, key_file=settings.redis_key,
                )
            )
        self._index = index
        self._policy = make_policy(settings.routing, index)
        self.sessions = SessionStore(settings.max_sessions, settings.session_idle_s)
        self.keys = KeyringFile(settings.api_keys_file) if settings.api_keys_file else None
        self.limiter = TenantLimiter()
        self._busy: set[str] = set()  # session keys with a request in flight
        # Chat templates and tokenization run here, off the event loop: a huge prompt must not
        # delay other requests or /health. A few threads, so one slow prompt does not queue others,
        # taken in turn by tenants (fairpool.py), so one tenant's backlog does not queue another's.
        self._tokenize_pool = FairPool(workers=4, name="tokenize")
        self._max_token_bytes = max_token_bytes(tokenizer)
        self.stats = GatewayStats()
        self.metrics = GatewayMetrics(lambda: self.stats.routed, lambda: self.stats.connect_failures)
        self.metrics.read("tandem_requests_in_flight", "Requests this gateway is serving now.", lambda: self._active)
        if index is not None:
            self.metrics.read("tandem_redis_errors", "Failed Redis calls (residency reads).",
                              lambda: index.errors, kind="counter")
        self._static: dict[str, VerifierRecord | None] = dict.fromkeys(settings.verifiers)  # last GetInfo
        self._registered: list[VerifierRecord] = []  # last read from Redis
        self._drafters: dict[str, DrafterInfo | None] = dict.fromkeys(settings.drafters)
        self._next_drafter = itertools.count()
        self._down: dict[str, float] = {}  # verifier id -> monotonic time until which it is skipped
        self._inflight: Counter[str] = Counter()  # verifier id -> this gateway's requests on it
        self._active = 0
        self._poller: asyncio.Task | None = None
        self._refreshing: asyncio.Task | None = None  # an on-demand refresh others may wait on
        self._refreshed_at = 0.0  # monotonic time of the last refresh's start
        self.draining = False  # SIGTERM: refuse new requests, let running ones finish (serve.py)
        self._streams: set[CommittedStream] = set()  # verifier calls in flight, cut at the drain's end
        self.metrics.read("tandem_streams_resumed", "Verifier streams cut mid-way and continued on another verifier.",
                          lambda: self.stats.resumed, kind="counter")
        eos = getattr(tokenizer, "eos_token_id", None)
        self._eos_ids = frozenset() if eos is None else frozenset([int(eos)])

    @classmethod
    def from_settings(cls, settings: GatewaySettings, clients: Upstream) -> "GatewayCore":
        from tandem.engine.model.tokenizer import load_tokenizer

        model_id, tokenizer, max_context = load_tokenizer(settings.model)
        return cls(settings, tokenizer, model_id=model_id, max_context_tokens=max_context, clients=clients)

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Poll the static verifiers, drafters and Redis once, then every poll_interval_s."""
        await self.refresh()
        self._poller = asyncio.create_task(self._poll_forever(), name="gateway-poller")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            try:
                await self._poller
            except asyncio.CancelledError:
                pass
        await self._clients.close()
        self._tokenize_pool.shutdown()
        if self._index is not None:
            self._index.close()

    async def refresh(self) -> None:
        s = self.settings
        self._refreshed_at = time.monotonic()
        verifiers = await asyncio.gather(*(self._clients.verifier_info(a, s.rpc_timeout_s) for a in self._static))
        for address, info in zip(list(self._static), verifiers):
            self._static[address] = info
            if info is not None:
                self._down.pop(info.verifier_id, None)
        drafters = await asyncio.gather(*(self._clients.drafter_info(a, s.rpc_timeout_s) for a in self._drafters))
        self._drafters.update(zip(list(self._drafters), drafters))
        if self._index is not None:
            self._registered = await asyncio.to_thread(self._index.verifiers)

    async def _refresh_soon(self) -> None:
        """Refresh now for a request that found no verifier (one may have come back since the last
        poll); concurrent callers share one refresh, and refreshes are at least _REFRESH_GAP_S
        apart, so requests arriving while nothing serves cannot flood the verifiers with GetInfo."""
        if self._refreshing is None or self._refreshing.done():
            wait = _REFRESH_GAP_S - (time.monotonic() - self._refreshed_at)
            if wait > 0:
                await asyncio.sleep(wait)
                if self._refreshing is not None and not self._refreshing.done():
                    await asyncio.shield(self._refreshing)
                    return
            self._refreshing = asyncio.create_task(self.refresh(), name="gateway-refresh")
        try:
            await asyncio.shield(self._refreshing)
        except Exception:  # a failed refresh leaves the last view; the caller decides
            log.exception("refreshing verifiers and drafters failed")

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval_s)
            try:
                await self.refresh()
            except Exception:  # a poll must never kill the gateway
                log.exception("polling verifiers and drafters failed")

    # -- queries ----------------------------------------------------------------------------

    def live_verifiers(self) -> list[VerifierRecord]:
        """Verifiers of the served model known alive at the last poll (static and registered)."""
        live = {r.verifier_id: r for r in self._static.values() if r is not None}
        live.update((r.verifier_id, r) for r in self._registered)
        return [r for r in live.values() if r.model_id == self.model_id]

    def context_window(self) -> int:
        limits = [r.max_context_tokens for r in self.live_verifiers() if r.max_context_tokens > 0]
        return min([self._max_context, *limits])

    def list_models(self) -> list[ModelCard]:
        offered = {s for info in self._drafters.values() if info is not None for s in info.strategies}
        strategies = (DraftStrategy.none, *sorted(offered - {DraftStrategy.none}, key=lambda d: d.value))
        live = self.live_verifiers()
        precision = " | ".join(sorted({r.precision for r in live if r.precision}))  # one, unless misconfigured
        return [ModelCard(self.model_name, True, self.context_window(), len(live), strategies, precision)]

    def health(self) -> dict:
        redis = "disabled" if self._index is None else ("ok" if self._index.redis_ok else "unavailable")
        live = len([r for r in self.live_verifiers() if not r.draining])
        return {
            "status": "draining" if self.draining else "ok" if live else "unavailable",
            "model": self.model_name,
            "verifiers": live,
            "redis": redis,
            "redis_errors": 0 if self._index is None else self._index.errors,
            "sessions": len(self.sessions),
            "requests_in_flight": self._active,
            "requests": self.stats.requests,
            "routed": dict(self.stats.routed),
            "failed": dict(self.stats.failed),
            "connect_failures": self.stats.connect_failures,
            "resumed": self.stats.resumed,
        }

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an `Authorization` header value (HTTP) or metadata entry (gRPC); an open
        gateway answers the anonymous tenant whatever is sent."""
        if self.keys is None:
            return OPEN
        key = bearer_key(authorization)
        tenant = self.keys.current().authenticate(key) if key else None
        if tenant is None:
            self.stats.failed["Unauthenticated"] += 1
            raise Unauthenticated(
                "a valid API key is required: send the header 'Authorization: Bearer KEY'"
                if key is None else "the API key is not valid"
            )
        return tenant

    def session(self, session_id: str, tenant: Tenant = OPEN) -> SessionInfo:
        # Another tenant's session and no session answer alike: nothing tells them apart.
        item = self.sessions.get(session_key(tenant, session_id))
        if item is None:
            raise UnknownSession(f"no session {clip(session_id)} on this gateway (never seen, or expired)")
        return SessionInfo(session_id, len(item.token_ids), item.verifier_id, time.monotonic() - item.last_used)

    def forget_session(self, session_id: str, tenant: Tenant = OPEN) -> None:
        key = session_key(tenant, session_id)
        if key in self._busy:
            raise SessionConflict(f"session {clip(session_id)} has a request in flight; delete it after that ends")
        if self.sessions.pop(key) is None:
            raise UnknownSession(f"no session {clip(session_id)} on this gateway (never seen, or expired)")

    # -- shutdown ---------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """SIGTERM: from now on new requests are refused (ShuttingDown: 503 / UNAVAILABLE, and
        /health answers 503 so balancers stop sending); running ones go on."""
        self.draining = True
        log.info("draining: %d requests in flight", self._active)

    @property
    def in_flight(self) -> int:
        return self._active

    def cut_streams(self) -> int:
        """The drain grace is over: end every running request with ShuttingDown (an SSE error
        event / UNAVAILABLE status, never a silent end). Returns how many were cut."""
        streams = list(self._streams)
        for stream in streams:
            stream.cut("the gateway is shutting down and its drain grace ended: the completion is incomplete; "
                       "retry the turn (the session keeps what streamed)")
        self.stats.cut_at_shutdown += len(streams)
        if streams:
            log.warning("drain grace over: cut %d streams", len(streams))
        return len(streams)

    # -- generation -------------------------------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Chunk]:
        """Stream the completion of `req`. Errors before the first chunk (bad request, no verifier,
        overload) are raised by the first `__anext__`, so a transport can still answer with a
        status; later ones are `UpstreamFailed` or `DeadlineExceeded`."""
        self.stats.requests += 1
        session_id_var.set(req.session_id)  # this request's task: its log lines name the session
        started, status = time.perf_counter(), "cancelled"  # unless it finishes or fails
        try:
            if log_prompts_enabled():
                log.info("prompt: %r", req.messages if req.messages is not None else req.prompt)
            if self.draining:
                raise ShuttingDown("this gateway is shutting down; send the request again (to another replica)")
            prep = await self._prepare(req)
            if prep.key is not None and prep.key in self._busy:
                raise SessionConflict(
                    f"session {clip(prep.session_id)} already has a request in flight: the turns of a "
                    "session are sequential (each continues the history the last one left); send the "
                    "next turn when this one has finished"
                )
            if self._active >= self.settings.max_concurrent_requests:
                raise Overloaded(
                    f"the gateway has {self._active} requests in flight (limit "
                    f"{self.settings.max_concurrent_requests}); retry later"
                )
            self.limiter.admit(prep.tenant, len(prep.context_ids), prep.sampling.max_new_tokens, held=req.slot is not None)
            self._active += 1
            if prep.key is not None:
                self._busy.add(prep.key)
            generated = 0
            try:
                # aclosing: a consumer that stops early (client gone) ends the verifier call now,
                # not whenever the abandoned generator is collected.
                async with aclosing(self._generate(prep)) as chunks:
                    last = None
                    async for chunk in chunks:
                        generated += len(chunk.token_ids)
                        if chunk.token_ids:
                            now = time.perf_counter()
                            if last is None:
                                self.metrics.first_token(now - started)
                            else:
                                self.metrics.tokens(len(chunk.token_ids), now - last)
                            last = now
                        yield chunk
                status = "ok"
            finally:
                self._active -= 1
                self._busy.discard(prep.key)
                self.limiter.release(prep.tenant, generated, held=req.slot is not None)
        except Exception as exc:
            self.stats.failed[type(exc).__name__] += 1
            status = status_of(exc)
            trace.get_current_span().record_exception(exc)  # an SSE stream's failure has no HTTP status
            raise
        finally:
            self.metrics.request(status)

    MAX_CHOICES = 8

    async def _choice_requests(self, req: GenerationRequest, n: int) -> list[GenerationRequest]:
        """The n one-off requests of OpenAI's `n`. The prompt is prefilled once: a one-token warm-up
        turn leaves its KV resident on a verifier, and the choices go there and copy it (the
        verifier shares a resident prefix of the same tenant). A seeded request gives choice i the
        seed + i."""
        if not 1 <= n <= self.MAX_CHOICES:
            raise InvalidRequest(f"n must be 1 to {self.MAX_CHOICES}, got {n}")
        if n > 1 and req.session_id:
            raise InvalidRequest("n > 1 makes several continuations; a session continues one: drop the session id")
        if n == 1:
            return [req]
        warm_id = f"n-{uuid.uuid4().hex}"
        warm = dataclasses.replace(req, session_id=warm_id, max_tokens=1, strategy="none", stop=(),
                                   top_logprobs=None, grammar=None, stop_token_ids=(), ignore_eos=True)
        async with aclosing(self.generate(warm)) as chunks:
            warmed = [c async for c in chunks]
        self.sessions.pop(session_key(req.tenant, warm_id))  # the verifier keeps the KV until it evicts it
        return [dataclasses.replace(req, prefer_verifier=warmed[-1].verifier_id,
                                    seed=None if req.seed is None else req.seed + i) for i in range(n)]

    async def generate_choices(self, req: GenerationRequest, n: int) -> list[list[Chunk]]:
        """`n` completions of one prompt (OpenAI's `n`), each a list of chunks (see `_choice_requests`)."""
        async def collect(r: GenerationRequest) -> list[Chunk]:
            async with aclosing(self.generate(r)) as chunks:
                return [c async for c in chunks]

        tasks = [asyncio.ensure_future(collect(c)) for c in await self._choice_requests(req, n)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed (or the client left): stop the others too
            for t in tasks:
                t.cancel()

    async def stream_choices(self, req: GenerationRequest, n: int) -> AsyncIterator[tuple[int, Chunk]]:
        """`n` completions of one prompt as they are produced: (choice index, chunk), the choices'
        chunks interleaved in arrival order, each choice's own in order. An error in one choice ends
        the stream with it (the others are stopped); so does the consumer's leaving."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, r: GenerationRequest) -> None:
            try:
                async with aclosing(self.generate(r)) as chunks:
                    async for chunk in chunks:
                        await queue.put((i, chunk))
                await queue.put((i, done))
            except Exception as exc:  # handed to the consumer, which raises it
                await queue.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(await self._choice_requests(req, n))]
        try:
            running = len(tasks)
            while running:
                i, item = await queue.get()
                if item is done:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _prepare(self, req: GenerationRequest) -> _Prepared:
        # "default" names whatever this deployment serves, so scripts need not know the model id.
        if req.model and req.model not in (self.model_name, self.model_id, "default"):
            raise InvalidRequest(f"model {clip(req.model)} is not served here; available: {self.model_name!r}")
        sid = req.session_id or None
        tenant = req.tenant
        key = session_key(tenant, sid) if sid else None
        input_cap = min(n for n in (tenant.max_input_tokens, self.settings.max_input_tokens, 1 << 62) if n)
        if req.prompt is not None or req.messages is not None:
            self._refuse_what_cannot_fit(req, min(input_cap, self.context_window()))
            context = await self._tokenize_pool.run(tenant.name, self._context_ids, req)
        else:
            context = self._continued(sid, key)
        if not context:
            raise InvalidRequest("the prompt renders to zero tokens")
        if len(context) > input_cap:
            raise InvalidRequest(
                f"the prompt is {len(context)} tokens (the session's whole history counts), above this "
                f"API key's limit of {input_cap} input tokens per request"
            )
        window = self.context_window()
        if len(context) >= window:
            raise InvalidRequest(
                f"the prompt is {len(context)} tokens but the model's context window is {window} tokens "
                "(prompt and completion together); shorten the prompt"
            )
        room = window - len(context)
        cap = min(self.settings.max_tokens_cap, tenant.max_output_tokens or self.settings.max_tokens_cap)
        if req.max_tokens is None:
            max_new = min(self.settings.default_max_tokens, room, cap)
        elif req.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {req.max_tokens}")
        elif req.max_tokens > cap:
            whose = "this API key's" if tenant.max_output_tokens == cap else "this gateway's"
            raise InvalidRequest(f"max_tokens is {req.max_tokens}, above {whose} limit of {cap}")
        elif req.max_tokens > room:
            raise InvalidRequest(
                f"the model's context window is {window} tokens: the prompt takes {len(context)}, leaving "
                f"{room} for the completion, but max_tokens is {req.max_tokens}"
            )
        else:
            max_new = req.max_tokens
        bad = [t for t in req.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids {bad[:8]}{' and more' if len(bad) > 8 else ''} are outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t, _ in req.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"logit_bias token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
        try:
            sampling = SamplingParams.from_given(
                max_new_tokens=max_new, **{name: getattr(req, name) for name in REQUEST_SAMPLING})
        except ValidationError as exc:
            raise InvalidRequest(_describe(exc)) from None
        overrides = {
            k: v for k, v in
            (("strategy", req.strategy), ("max_draft_tokens", req.max_draft_tokens), ("adaptive", req.adaptive))
            if v is not None
        }
        try:
            spec = SpecConfig.model_validate({**self.settings.default_speculation.model_dump(), **overrides})
        except ValidationError as exc:
            raise InvalidRequest(_describe(exc, "speculation.")) from None
        timeout = self.settings.request_timeout_s
        if req.timeout_s is not None:
            timeout = min(timeout, req.timeout_s)
        return _Prepared(req.prefer_verifier, sid, key, tenant, context, sampling, spec, timeout)

    def _continued(self, sid: str | None, key: str | None) -> list[int]:
        """Neither prompt nor messages: continue the session from its history."""
        if key is None:
            raise InvalidRequest("no input: give a prompt or messages (or a session_id to continue)")
        session = self.sessions.get(key)
        if session is None:
            raise UnknownSession(f"no session {clip(sid)} to continue (never seen, or expired)")
        return list(session.token_ids)

    def _refuse_what_cannot_fit(self, req: GenerationRequest, limit: int) -> None:
        """Refuse, before any tokenization, a text that cannot come to `limit` tokens or fewer: no
        token of this vocabulary covers more than `_max_token_bytes` bytes, so a text of B bytes is
        at least B / that many tokens. (A 3.9 MB prompt once held a tokenizer thread for 40 s to
        end in the same 400, while other tenants' requests queued behind it.)"""
        if self._max_token_bytes is None:
            return  # no bound for this tokenizer: the limits apply after tokenization
        text_bytes = len(req.prompt.encode("utf-8", "surrogatepass")) if isinstance(req.prompt, str) else 0
        for m in req.messages or ():
            content = m.get("content")
            if isinstance(content, str):
                text_bytes += len(content.encode("utf-8", "surrogatepass"))
        at_least = text_bytes // self._max_token_bytes
        if at_least > limit:
            raise InvalidRequest(
                f"the prompt is {text_bytes} bytes, so at least {at_least} tokens, above the limit of {limit} "
                "input tokens (this API key's, or the model's context window): send a shorter prompt")

    def _context_ids(self, req: GenerationRequest) -> list[int]:
        """The token ids of a request's prompt or messages. Runs on the tokenizer pool."""
        if req.prompt is not None and req.messages is not None:
            raise InvalidRequest("give either prompt or messages, not both")
        if req.messages is not None:
            if not req.messages:
                raise InvalidRequest("messages is empty")
            for i, m in enumerate(req.messages):
                if not isinstance(m.get("role"), str) or not m["role"]:
                    raise InvalidRequest(f"messages[{i}].role must be a non-empty string")
                if not isinstance(m.get("content"), str):
                    raise InvalidRequest(f"messages[{i}].content must be a string")
                _check_text(m["content"], f"messages[{i}].content")
            uses_tools = req.tool_functions or any(m.get("tool_calls") or m.get("role") == "tool" for m in req.messages)
            if uses_tools and self.tool_support.renderer == tool_calls.GATEWAY and not self.settings.tool_fallback:
                raise InvalidRequest(
                    f"the chat template of {self.model_name} {self.tool_support.why}, and this gateway does not fall "
                    "back to its <tool_call> convention (started with --no-tool-fallback): send the request without tools")
            try:
                context = (tool_calls.render(self.tokenizer, req.messages, list(req.tool_functions), apply_chat_template,
                                        self.tool_support)
                           if uses_tools else apply_chat_template(self.tokenizer, req.messages))
            except jinja2.TemplateError as exc:  # the template's own checks (role order, unknown roles)
                raise InvalidRequest(f"the model's chat template cannot render these messages: {exc}") from None
            except Exception:  # anything else is the library's business, not the client's to read
                log.exception("rendering a chat failed")
                raise InvalidRequest("the model's chat template cannot render these messages") from None
        elif isinstance(req.prompt, str):
            if not req.prompt:
                raise InvalidRequest("prompt is empty")
            _check_text(req.prompt, "prompt")
            context = list(self.tokenizer(req.prompt)["input_ids"])
        elif req.prompt is not None:
            context = list(req.prompt)
            bad = [t for t in context if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
        return context

    async def _route(self, prep: _Prepared, exclude: set[str]) -> RoutingDecision | None:
        now = time.monotonic()
        exclude = exclude | {vid for vid, until in self._down.items() if until > now}
        candidates = [r for r in self._static.values() if r is not None]
        inflight = dict(self._inflight)
        # Where this gateway last sent the session: it stands in for a session key Redis lacks (a
        # verifier publishes a turn only as it ends; Redis may be down or disabled).
        session = self.sessions.get(prep.key) if prep.key else None
        affinity = None
        if session is not None and session.verifier_id is not None:
            affinity = (session.verifier_id, common_prefix_len(session.token_ids, prep.context_ids))
        elif prep.prefer_verifier is not None:
            affinity = (prep.prefer_verifier, len(prep.context_ids))
        route = functools.partial(
            self._policy.route, prep.key, prep.context_ids, candidates,
            model_id=self.model_id, exclude=exclude, inflight=inflight, affinity=affinity,
            salt=prep.tenant.name,
        )
        # Reading Redis blocks: off the event loop. Without Redis the policy is pure and instant.
        return route() if self._index is None else await asyncio.to_thread(route)

    def _drafter_for(self, session: _Session | None, strategy: DraftStrategy) -> str:
        if strategy == DraftStrategy.none:
            return ""
        offering = [a for a, info in self._drafters.items() if info is not None and strategy in info.strategies]
        if not offering:
            return ""  # the verifier decodes plainly
        if session is not None and session.drafters.get(strategy) in offering:
            return session.drafters[strategy]  # its draft state lives there
        return offering[next(self._next_drafter) % len(offering)]

    async def _connect(
        self, prep: _Prepared, request: VerifierRequest, deadline: float, exclude: frozenset[str] = frozenset(),
        wait_s: float = 0.0,
    ) -> tuple[RoutingDecision, CommittedStream, CommittedTokens]:
        """Open the stream on the best verifier that answers; the first message proves it did.
        `exclude`: verifiers not to try (one that just failed mid-stream). When no verifier can be
        tried, refresh the view once (one may have come back since the last poll) and, for up to
        `wait_s` (a resumed stream), keep polling for one."""
        tried: set[str] = set(exclude)
        failures: list[str] = []
        full: set[str] = set()  # verifiers that refused for lack of KV cache (the other failures: unreachable)
        refreshed = False
        wait_until = min(deadline, time.monotonic() + wait_s)
        while True:
            with tracer.start_as_current_span("route") as span:
                decision = await self._route(prep, tried)
                self._trace_route(span, prep, decision, tried)
            if decision is None:
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded("the request's deadline passed before a verifier could take it")
                if failures and len(full) == len(failures):
                    raise Overloaded(f"every verifier's KV cache is full ({'; '.join(failures)}); retry later")
                if not self.draining and (not refreshed or time.monotonic() < wait_until):
                    # The view may be stale (a verifier came back, or the one tried is gone for
                    # good): refresh it and route again; a resumed stream keeps at it for wait_s.
                    # After the first refresh the verifier that cut the stream may take it again,
                    # if the view says it serves (restarted in place, or only its connection
                    # broke): the resume budget bounds a verifier that keeps cutting.
                    if not refreshed:
                        log.info("no verifier to take the request now; refreshing%s",
                                 f" and waiting up to {wait_s:.0f} s for one" if wait_s else "")
                    await self._refresh_soon()
                    tried = (full | set(exclude)) if not refreshed else set(full)  # unreachable: skipped while marked down
                    refreshed = True
                    continue
                detail = "; ".join(dict.fromkeys(failures)) if failures else self._why_none(exclude)
                raise NoVerifierAvailable(f"no verifier available: {detail}")
            # A full verifier queues a request for room (its --admission-wait-s, 60 s): while
            # another verifier is left to try, ask it to wait only briefly, so it does not hold a
            # request another could start now; the last candidate keeps its own wait.
            now = time.monotonic()
            others = [r for r in self.live_verifiers() if r.verifier_id not in tried | {decision.verifier_id}
                      and not r.draining and self._down.get(r.verifier_id, 0.0) <= now]
            attempt = dataclasses.replace(request, admission_wait_s=HOP_ADMISSION_WAIT_S if others else 0.0)
            stream = self._clients.generate(decision.address, attempt, max(0.001, deadline - time.monotonic()))
            self._streams.add(stream)  # from now on a shutdown's cut reaches it
            try:
                try:
                    first = await stream.__anext__()
                except BaseException:
                    self._streams.discard(stream)
                    raise
                return decision, stream, first
            except StopAsyncIteration:
                # Nothing streamed, so nothing is lost by asking the next verifier (a verifier
                # that ends a call without a word is broken, not busy): the client sees an answer.
                log.warning("verifier %s ended the stream without a message; trying the next one", decision.verifier_id)
                failures.append(f"verifier {decision.verifier_id} ended the stream without a message")
                self._down[decision.verifier_id] = time.monotonic() + self.settings.down_backoff_s
            except VerifierUnreachable as exc:
                self.stats.connect_failures += 1
                trace.get_current_span().add_event(
                    "verifier_unreachable", {"tandem.verifier_id": decision.verifier_id, "tandem.error": str(exc)})
                self._down[decision.verifier_id] = time.monotonic() + self.settings.down_backoff_s
                log.warning("verifier %s unreachable, trying the next one: %s", decision.verifier_id, exc)
                # Clients learn which verifier failed, not its address or the transport's detail.
                failures.append(f"verifier {decision.verifier_id} unreachable")
            except VerifierBusy as exc:
                full.add(decision.verifier_id)
                trace.get_current_span().add_event(
                    "verifier_busy", {"tandem.verifier_id": decision.verifier_id, "tandem.error": str(exc)})
                failures.append(f"verifier {decision.verifier_id}: KV cache full")
            tried.add(decision.verifier_id)

    def _why_none(self, exclude: frozenset[str]) -> str:
        """Why routing found nothing, in words a client may read (ids, not addresses)."""
        live = self.live_verifiers()
        serving = [r.verifier_id for r in live if r.verifier_id not in exclude and not r.draining]
        if serving:  # known, but skipped after refusing connections
            return f"verifiers {sorted(serving)} refused connections moments ago"
        parts = [f"no live verifier serves model {self.model_id!r}"]
        draining = sorted(r.verifier_id for r in live if r.draining)
        if draining:
            parts.append(f"draining: {draining}")
        if exclude:
            parts.append(f"failed during this request: {sorted(exclude)}")
        others = {r.model_id for r in [*self._registered, *self._static.values()]
                  if r is not None and r.model_id != self.model_id}
        if others:
            parts.append(f"other models served: {sorted(others)}")
        return "; ".join(parts)

    def _trace_route(self, span, prep: _Prepared, decision: RoutingDecision | None, tried: set[str]) -> None:
        """The routing decision and why, on its span."""
        if not span.is_recording():
            return
        redis = "disabled" if self._index is None else ("ok" if self._index.redis_ok else "unavailable")
        span.set_attributes({
            "tandem.session_id": prep.session_id or "",
            "tandem.context_tokens": len(prep.context_ids),
            "tandem.routing.excluded": sorted(tried),
            "tandem.routing.redis": redis,
        })
        if decision is not None:
            span.set_attributes({
                "tandem.routing.verifier_id": decision.verifier_id,
                "tandem.routing.reason": decision.reason,
                "tandem.routing.matched_tokens": decision.matched_tokens,
                "tandem.routing.residency": "hit" if decision.reason in RESIDENCY_HITS else "miss",
            })

    @staticmethod
    async def _drain(stream: CommittedStream, vid: str) -> None:
        """After the final message, let the verifier end the call itself rather than cancel it: it
        publishes the session's residency as the turn ends, so the client's next turn (sent once
        this one completed) finds it in Redis. A verifier that does not close promptly is
        cancelled by the caller's cleanup; the output is complete either way."""
        try:
            extra = await asyncio.wait_for(anext(stream, None), _DRAIN_S)
        except Exception as exc:  # timeout or a failure after the final message: nothing is lost
            log.debug("verifier %s did not close cleanly after its final message: %r", vid, exc)
            return
        if extra is not None:
            log.warning("verifier %s sent a message after its final one; ignored", vid)

    async def _generate(self, prep: _Prepared) -> AsyncIterator[Chunk]:
        sid, context, sampling = prep.key, prep.context_ids, prep.sampling
        session = self.sessions.get(sid) if sid else None
        drafter = self._drafter_for(session, prep.spec.strategy)
        deadline = time.monotonic() + prep.timeout_s
        request = VerifierRequest(sid or "", context, sampling, prep.spec, drafter, cache_salt=prep.tenant.name)
        decision, stream, msg = await self._connect(prep, request, deadline)
        vid = decision.verifier_id
        self.stats.routed[decision.reason] += 1
        # The verifier does not stream the stop token that ends a reply; should a verifier send one
        # anyway it is never shown (a stop id can only be the last token, so leaving these ids out
        # of the text is exact).
        hidden = sampling.stop_ids(self._eos_ids)
        detok = Detokenizer(self.tokenizer)
        cut = TextCut(sampling.stop)
        generated: list[int] = []
        offset = 0  # tokens streamed before the current verifier's call (earlier verifiers, failover)
        resumes = 0
        self._inflight[vid] += 1
        try:
            while True:
                try:
                    async for chunk in self._read(stream, msg, vid, decision, prep, generated, offset,
                                                  hidden, detok, cut):
                        yield dataclasses.replace(chunk, resumed=resumes) if chunk.finish_reason else chunk
                    return
                except StreamCut as exc:
                    if resumes >= self.settings.resume_attempts or self.draining or time.monotonic() >= deadline:
                        raise
                    resumes += 1
                    stream.cancel()
                    self._streams.discard(stream)
                    log.warning("verifier %s cut the stream after %d tokens (%s); resuming on another verifier",
                                vid, len(generated), exc)
                    trace.get_current_span().add_event("stream_resumed", {
                        "tandem.verifier_id": vid, "tandem.streamed_tokens": len(generated), "tandem.error": str(exc)})
                    left = sampling.max_new_tokens - len(generated)
                    if left <= 0:  # every token streamed; only the final message was lost
                        yield dataclasses.replace(self._final(vid, decision, prep, generated, offset, hidden, detok,
                                                              cut, FinishReason.length, SpecStats()), resumed=resumes)
                        return
                    resumed = VerifierRequest(
                        sid or "", context + generated, self._resumed_sampling(sampling, len(generated), left),
                        prep.spec, drafter, cache_salt=prep.tenant.name, resumed_tokens=len(generated))
                    try:
                        decision, stream, msg = await self._connect(
                            dataclasses.replace(prep, context_ids=context + generated), resumed, deadline,
                            exclude=frozenset({vid}), wait_s=self.settings.resume_wait_s)
                    except (NoVerifierAvailable, Overloaded, DeadlineExceeded) as again:
                        raise StreamCut(f"{exc}; no other verifier could continue it ({again})") from None
                    self.stats.resumed += 1
                    self._inflight[vid] -= 1
                    if not self._inflight[vid]:
                        del self._inflight[vid]
                    vid, offset = decision.verifier_id, len(generated)
                    self._inflight[vid] += 1
        finally:
            stream.cancel()
            self._streams.discard(stream)
            self._inflight[vid] -= 1
            if not self._inflight[vid]:
                del self._inflight[vid]
            if sid:
                # Tokens streamed before a failure are a valid prefix of the output: keep them.
                item = session or _Session(token_ids=[])
                item.token_ids, item.verifier_id = context + generated, vid
                if drafter:
                    item.drafters[prep.spec.strategy] = drafter
                self.sessions.put(sid, item)

    @staticmethod
    def _resumed_sampling(sampling: SamplingParams, streamed: int, left: int) -> SamplingParams:
        """The sampling of a request continued after `streamed` tokens: `left` more at most, and a
        seeded request's seed moved to a stream of its own (the original seed would replay the
        random draws that already chose the streamed tokens, correlating the rest with them)."""
        update: dict = {"max_new_tokens": left}
        if sampling.seed is not None:
            digest = hashlib.sha256(f"tandem-resume:{sampling.seed}:{streamed}".encode()).digest()
            update["seed"] = int.from_bytes(digest[:7], "little")
        return sampling.model_copy(update=update)

    async def _read(self, stream: CommittedStream, msg: CommittedTokens | None, vid: str, decision: RoutingDecision,
                    prep: _Prepared, generated: list[int], offset: int, hidden, detok: Detokenizer,
                    cut: TextCut) -> AsyncIterator[Chunk]:
        """The chunks of one verifier call, from its first message `msg`; appends to `generated`
        (the request's whole output so far, `offset` of it from earlier calls)."""
        context, sampling = prep.context_ids, prep.sampling
        while msg is not None:
            if msg.first_index != len(generated) - offset:
                raise UpstreamFailed(
                    f"verifier {vid} broke the protocol: a chunk starts at output index "
                    f"{msg.first_index}, expected {len(generated) - offset}"
                )
            ids = msg.token_ids
            generated.extend(ids)
            if len(generated) > sampling.max_new_tokens:
                raise UpstreamFailed(
                    f"verifier {vid} broke the protocol: {len(generated)} tokens for max_tokens "
                    f"{sampling.max_new_tokens}"
                )
            finish = msg.finish_reason
            final = finish is not None
            if final and finish not in (FinishReason.stop, FinishReason.length):
                raise UpstreamFailed(
                    f"verifier {vid} stopped with {finish.value} after "
                    f"{len(generated)} tokens; the completion is incomplete"
                )
            if not final:
                text = cut.push(detok.push([t for t in ids if t not in hidden], final=False), final=False)
                if ids:
                    yield Chunk(text, ids, offset + msg.first_index, vid, logprobs=msg.logprobs,
                                prompt_tokens=len(context))
                msg = await anext(stream, None)
                continue
            yield self._final(vid, decision, prep, generated, offset, hidden, detok, cut, finish,
                              msg.stats or SpecStats(), ids=ids, first_index=offset + msg.first_index,
                              logprobs=msg.logprobs)
            await self._drain(stream, vid)
            return
        raise UpstreamFailed(
            f"verifier {vid} ended the stream after {len(generated)} tokens without a finish reason; "
            "the completion is incomplete"
        )

    def _final(self, vid: str, decision: RoutingDecision, prep: _Prepared, generated: list[int], offset: int,
               hidden, detok: Detokenizer, cut: TextCut, finish: FinishReason, stats: SpecStats, *,
               ids: tuple[int, ...] = (), first_index: int | None = None, logprobs=None) -> Chunk:
        """The last chunk: the rest of the text, the finish reason, usage and the verifier's figures."""
        context = prep.context_ids
        text = cut.push(detok.push([t for t in ids if t not in hidden], final=True), final=True)
        cached = min(stats.prefill_reused_tokens, len(context))
        log.info("completed on %s (routed by %s): %d prompt tokens (%d cached) + %d generated%s, finish %s; "
                 "drafted %d, accepted %d in %d steps", vid, decision.reason, len(context), cached,
                 len(generated), f" ({offset} before a failover)" if offset else "", finish.value,
                 stats.drafted, stats.accepted, stats.steps)
        return Chunk(
            text, tuple(ids), len(generated) - len(ids) if first_index is None else first_index, vid,
            logprobs=logprobs, prompt_tokens=len(context), finish_reason=finish,
            usage=Usage(len(context), len(generated), cached if not offset else 0),
            stats=stats, routing=decision,
        )
