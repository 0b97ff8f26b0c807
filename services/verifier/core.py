"""The verifier's domain object: the target model, its sessions' KV caches and their decode loops.

No gRPC here (the servicer in server.py translates): the remote drafter is reached through a
`DrafterConnector` given at construction (drafter_client.py's over gRPC) and wrapped in a
`RemoteProposer`, which the loop sees as any other proposer.

Sessions: a request with a session id reuses that session's KV cache (its `Sequence`): a later turn
sends the whole conversation, the longest resident prefix is kept and only the new tokens are
prefilled. Idle sessions are evicted least-recently-used when the KV budget (tokens) or the session
limit is exceeded; every change is mirrored in Redis by the residency publisher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from tandem.contract.ids import common_prefix_len
from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.contract.results import GenerationResult, StepOutput
from tandem.contract.results import FinishReason
from tandem.engine.model.loading import LoadedModel
from tandem.engine.scheduler.generate import Engine, trees_allowed
from tandem.engine.scheduler.prefill import PrefillPolicy
from tandem.engine.scheduler.runner import Sequence
from tandem.engine.speculation.suffix import scope_of
from tandem.serving.logs import session_context
from tandem.serving.metrics import VerifierMetrics, status_of
from tandem.serving.telemetry import tracer

from .drafting import DrafterConnector, RemoteProposer
from .settings import VerifierSettings, drafter_address as canonical_drafter

log = logging.getLogger("tandem.verifier")


MAX_SALT_BYTES = 64  # a tenant name; longer is a client bug or an attack on memory
STEP_POLL_S = 0.05  # how often a handler waiting for its next step looks at its client and the drain


class InvalidRequest(ValueError):
    """The request cannot be served as asked; the message says why (INVALID_ARGUMENT)."""


class SessionBusy(RuntimeError):
    """Another request of the same session is still generating (ABORTED: retry after it ends)."""


class Draining(RuntimeError):
    """The verifier is shutting down (UNAVAILABLE): a new request belongs on another verifier, and a
    stream cut at the end of the drain grace continues there (the gateway resumes it)."""


class Overloaded(RuntimeError):
    """No KV budget or session slot is free (RESOURCE_EXHAUSTED, with a retry hint)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Cancelled(RuntimeError):
    """The caller went away while its request waited for admission (CANCELLED)."""


def kv_bytes_per_token(target: LoadedModel) -> int:
    """Bytes of KV cache one token takes in `target`: K and V for every layer and KV head."""
    cfg = target.model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = next(target.model.parameters()).dtype
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def free_memory_bytes(device) -> int:
    """Memory free for KV now: the GPU's (CUDA) or the host's available RAM (MemAvailable)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget_tokens(settings: VerifierSettings, target: LoadedModel, per_token: int | None = None) -> int:
    """The KV budget in tokens: kv_capacity_tokens, or less where kv_memory_fraction of the free
    memory holds fewer tokens of this model's KV (`per_token` bytes a token: the forward's own
    cache type, e.g. float16 for a GGUF target; default: the model's dtype)."""
    if settings.kv_memory_fraction is None:
        return settings.kv_capacity_tokens
    device = next(target.model.parameters()).device
    per_token = per_token or kv_bytes_per_token(target)
    free = free_memory_bytes(device)
    tokens = max(1, int(free * settings.kv_memory_fraction) // per_token)
    chosen = min(tokens, settings.kv_capacity_tokens)
    log.info("KV budget %d tokens: %.0f%% of %.1f GiB free on %s at %d bytes a token holds %d (cap %d)",
             chosen, 100 * settings.kv_memory_fraction, free / 2**30, device, per_token, tokens,
             settings.kv_capacity_tokens)
    return chosen


# A cache's capacity doubles as it grows (from 256 slots), so resident sessions holding B tokens in
# all may hold up to 2 B slots, plus the first 256 of each; a growing cache holds its old and new
# region for the moment of the move.
KV_POOL_GROWTH = 2
KV_POOL_FIRST_SLOTS = 256
KV_POOL_MAX_MEMORY = 0.9  # at most this share of the device's free memory


def kv_pool_slots(budget_tokens: int, max_sessions: int, free_bytes: int, bytes_per_slot: int) -> int:
    """Slots of a GPU's KV pool for a verifier with a KV budget of `budget_tokens` over at most
    `max_sessions` sessions: enough that caches of every admitted session fit in it as they grow
    (a pool that runs out sends caches to tensors of their own: slower, never refused), and at most
    KV_POOL_MAX_MEMORY of the free memory."""
    wanted = KV_POOL_GROWTH * budget_tokens + KV_POOL_FIRST_SLOTS * max_sessions
    return max(1, min(wanted, int(free_bytes * KV_POOL_MAX_MEMORY) // bytes_per_slot))


LOST_REMEMBERED = 1024  # evicted sessions whose tokens are kept (4 bytes a token) to count recomputation


def prefix_key(salt: str, ids) -> tuple | None:
    """What sessions whose KV may be shared have in common: the tenant and the first
    SHARE_MIN_TOKENS tokens (None for a shorter context, which is not worth sharing)."""
    return (salt, tuple(ids[: Sequence.SHARE_MIN_TOKENS])) if len(ids) >= Sequence.SHARE_MIN_TOKENS else None


@dataclass
class _Session:
    seq: Sequence
    salt: str = ""  # cache_salt: KV is shared only with sessions of the same salt (tenant)
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    reserved: int = 0  # context tokens admitted for while generating (its prefill may not have run yet)
    expect: int = 0  # of them, what admission expected to read from a resident session's shared prefix
    lost: array | tuple = ()  # the tokens an eviction took from this session id (for the recompute count)

    def kv(self) -> tuple[int, tuple[int, int] | None, int | None]:
        """(KV tokens of its own this session counts against the budget, and `Sequence.kv_parts`'
        shared prefix and own storage: a prefix counts once for all its readers, `_kv_used`)."""
        own, prefix, own_key = self.seq.kv_parts()
        return max(0, own, self.reserved - self.expect if self.busy else 0), prefix, own_key


def _kv_used(sessions: Iterable[_Session]) -> int:
    """KV tokens `sessions` hold: each one's own, plus each shared prefix once unless it lies in the
    own storage of one of them (that one counts it already)."""
    used, owners, prefixes = 0, set(), {}
    for sess in sessions:
        held, prefix, own_key = sess.kv()
        used += held
        owners.add(own_key)
        if prefix is not None:
            prefixes[prefix[0]] = max(prefixes.get(prefix[0], 0), prefix[1])
    return used + sum(n for key, n in prefixes.items() if key not in owners)


class VerifierCore:
    def __init__(
        self,
        settings: VerifierSettings,
        target: LoadedModel,
        *,
        publisher=None,  # tandem.serving.residency.ResidencyPublisher or None
        metrics: VerifierMetrics | None = None,
        connector: DrafterConnector | None = None,
    ):
        """`connector` reaches drafters by address; None: requests naming a drafter decode with
        the verifier's own prompt lookup (ngram) or plainly."""
        self.settings = settings
        self.target = target
        self.engine = Engine(target, None, SpecConfig(max_draft_tokens=settings.max_draft_tokens))
        self.publisher = publisher
        self.connector = connector
        self.address = settings.advertise_address or f"{settings.host}:{settings.port}"
        self.executor = self.engine.runner.enable_batching(
            PrefillPolicy(max_piece=settings.prefill_chunk_tokens, min_piece=settings.prefill_min_tokens,
                          cost_factor=settings.prefill_cost_factor))
        impl = getattr(self.engine.runner.backend, "impl", None)  # the native forward knows its cache type
        self.kv_capacity = kv_budget_tokens(settings, target, getattr(impl, "kv_bytes_per_slot", None))
        self._size_kv_pool()
        self._lock = threading.Lock()  # guards the session table
        self._room = threading.Condition(self._lock)  # notified when a session stops generating
        self._waiting: list[object] = []  # admission queue: tickets of requests waiting for room, FIFO
        self._turns: set[object] = set()  # of them, next turns of resident sessions (they go first)
        self._gaps: deque[float] = deque(maxlen=256)  # seconds between a session's turns, lately
        self._heads: deque[tuple] = deque(maxlen=64)  # (salt, first tokens) of the sessions lately admitted
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        # session id -> the tokens an eviction took (oldest first, bounded): when the session comes
        # back, what it computes again of them is counted (tandem_prefill_recomputed_tokens).
        self._lost: OrderedDict[str, array] = OrderedDict()
        # Requests without a session id: nobody can resume them, so they are never resident, but
        # while they run their KV counts against the budget and they take a session slot like any
        # other (otherwise anonymous requests would be an unbounded way around admission).
        self._anonymous: dict[int, _Session] = {}  # by id(): sessions compare by value
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        # Draining (SIGTERM): new requests are refused; at the end of the grace the running ones
        # are cut between steps (`_cut`), each with an explicit status, never a silent end.
        self.draining = False
        self._cut = threading.Event()
        self._running = 0  # generations in progress (guarded by _lock)
        self.metrics = metrics or VerifierMetrics()
        self.executor.on_step = self.metrics.loop_step
        self.metrics.watch_kv(self.kv_capacity, self.kv_used_tokens, lambda: len(self._sessions))
        self.metrics.read("tandem_admission_waiting", "Requests waiting for KV room (admission queue).",
                          lambda: len(self._waiting))
        self.metrics.read("tandem_prefill_pieces", "Prompt pieces run (chunked prefill).",
                          lambda: self.executor.prefill_pieces, kind="counter")
        if publisher is not None:
            self.metrics.read("tandem_redis_errors", "Failed Redis calls (residency publishing).",
                              lambda: publisher.errors, kind="counter")

    def _size_kv_pool(self) -> None:
        """Where the forward keeps caches in a KV pool (a GPU), size the pool from the KV budget
        rather than the model's default share of memory, so what admission lets in fits in it."""
        impl = getattr(self.engine.runner.backend, "impl", None)
        if impl is None or not getattr(impl, "pools_by_default", False):
            return
        free = free_memory_bytes(impl.device)
        slots = kv_pool_slots(self.kv_capacity, self.settings.max_sessions, free, impl.kv_bytes_per_slot)
        try:
            impl.size_kv_pool(slots)
        except RuntimeError as exc:  # a cache was made before (the model is shared): keep its pool
            log.warning("KV pool left at %d slots, not sized from the budget: %s",
                        impl.kv_pool.k.shape[2] if impl.kv_pool is not None else 0, exc)
            return
        log.info("KV pool: %d slots (%.1f GiB) for a budget of %d tokens over up to %d sessions",
                 slots, slots * impl.kv_bytes_per_slot / 2**30, self.kv_capacity, self.settings.max_sessions)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, address: str | None = None) -> None:
        if address:
            self.address = address
        if self.publisher is not None:
            if self.publisher.register(self.info()):
                self.publisher.forget_stale(self.settings.verifier_id)  # a restart holds no KV yet
            self._heartbeat = threading.Thread(target=self._beat, daemon=True, name="heartbeat")
            self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            self.publisher.heartbeat(self.info())

    def drain(self) -> None:
        """Shutting down: refuse new requests from now on and say so in Redis (the registration's
        `draining` field, kept fresh by the heartbeat) and in GetInfo, so gateways route new work
        elsewhere while running generations finish."""
        self.draining = True
        if self.publisher is not None:
            self.publisher.heartbeat(self.info())
        log.info("draining: %d generations running, new requests go elsewhere", self.running())

    def running(self) -> int:
        with self._lock:
            return self._running

    def cut(self) -> None:
        """The drain grace is over: end every running generation at its next step with Draining
        (UNAVAILABLE, which the gateway resumes on another verifier)."""
        n = self.running()
        if n:
            log.warning("drain grace over: cutting %d running generations (their gateways resume them elsewhere)", n)
        self._cut.set()

    def stop(self) -> None:
        self._stop.set()
        if self.publisher is not None:
            with self._lock:
                sessions = list(self._sessions.items())
            for sid, sess in sessions:
                self.publisher.evict_session(sid, sess.seq.ids, sess.salt)
            self.publisher.deregister(self.settings.verifier_id)
        if self.connector is not None:
            self.connector.close()

    # -- queries --------------------------------------------------------------------------------

    def _live(self) -> list[_Session]:
        """Every session that holds KV: the resident ones and running anonymous requests. Caller
        holds self._lock."""
        return [*self._sessions.values(), *self._anonymous.values()]

    def _generating(self) -> int:
        """Sessions generating now (resident ones marked busy, and running anonymous requests).
        Caller holds self._lock."""
        return sum(1 for s in self._sessions.values() if s.busy) + len(self._anonymous)

    def kv_used_tokens(self) -> int:
        with self._lock:
            return _kv_used(self._live())

    def info(self) -> dict:
        with self._lock:
            active = self._generating()
            used = _kv_used(self._live())
            resident = len(self._sessions)
        return {
            "verifier_id": self.settings.verifier_id,
            "address": self.address,
            "model_id": self.target.model_id,
            "vocab_size": self.target.vocab_size,
            "max_context_tokens": self.target.max_context,
            "kv_capacity_tokens": self.kv_capacity,
            "kv_used_tokens": used,
            "active_sessions": active,
            "resident_sessions": resident,
            "eos_token_ids": self.target.eos_token_ids,
            "draining": self.draining,
            "precision": self.engine.runner.precision,  # what its output is lossless against
        }

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    # -- generation -----------------------------------------------------------------------------

    def validate(self, context_ids: list[int], sampling: SamplingParams) -> None:
        if not context_ids:
            raise InvalidRequest("context_ids is empty: a generation needs at least one token")
        vocab = self.target.vocab_size
        bad = next((t for t in context_ids if t < 0 or t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"context token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t, _ in sampling.logit_bias if t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")
        if len(context_ids) >= self.target.max_context:
            raise InvalidRequest(
                f"context of {len(context_ids)} tokens does not fit the context window of "
                f"{self.target.max_context} tokens of {self.target.model_id}"
            )

    def allowed_drafter(self, requested: str) -> str:
        """The allowlist's entry (settings.drafters) for the drafter a request names, '' for none.

        A request names a drafter; it never decides where we connect: we dial the configured entry,
        not the caller's string, and refuse anything not on the list before any connection is made
        (a caller must not make the verifier probe hosts, ports or local sockets)."""
        if not requested.strip():
            return ""
        try:
            address = canonical_drafter(requested)
        except ValueError:
            address = None  # not even host:port (unix:/path, dns:///...): on no allowlist
        if address in self.settings.drafters:
            return address
        shown = requested[:100]  # the caller's string: bounded in the message
        if not self.settings.drafters:
            raise InvalidRequest(
                f"drafter {shown!r} is not on this verifier's allowlist: it allows no drafter; start the "
                f"verifier with --drafter HOST:PORT (or TANDEM_DRAFTERS) to allow one")
        raise InvalidRequest(f"drafter {shown!r} is not on this verifier's allowlist (its --drafter options)")

    def _checkout(self, session_id: str, context_len: int, salt: str = "",
                  is_active: Callable[[], bool] = lambda: True, key: tuple | None = None,
                  wait_s: float = 0.0, context_ids: list[int] | None = None) -> _Session:
        """The session's resident state (created if new), marked busy; evicts idle sessions LRU to
        make room. A resident session of another salt is not this caller's: it is dropped and the
        request starts fresh (its KV is never read across salts).

        Admission: when running sessions hold the budget, the request waits its turn for room, up
        to settings.admission_wait_s and behind at most settings.admission_queue others; past
        either it gets Overloaded with a retry hint. The next turn of a resident session goes
        before new sessions (it needs only its new tokens, and its conversation ends only if it
        runs), and a new session may not evict a session that ended a turn more recently than the
        next turns here usually take to come (`_protect_s`, at most settings.evict_after_idle_s):
        it waits instead.
        Measured on 64 agent sessions (docs/benchmarks.md, "Many sessions"): without these, new
        sessions evicted conversations between their turns, whose next turns then evicted others,
        and 60% of the prefill was recomputation."""
        if context_len > self.kv_capacity:  # could never fit here: no use waiting
            raise Overloaded(f"verifier {self.settings.verifier_id}: a context of {context_len} tokens is larger "
                             f"than its whole KV budget of {self.kv_capacity} tokens", retry_after_s=60.0)
        ticket = object()
        with self._lock:
            try:
                while True:
                    why = f"verifier {self.settings.verifier_id}"  # what is full, when _admit tried
                    try:
                        if self._may_try(ticket, session_id):
                            return self._admit(session_id, context_len, salt, key, context_ids)
                        ahead = self._waiting.index(ticket) if ticket in self._waiting else len(self._waiting)
                        why = f"verifier {self.settings.verifier_id}: {ahead} requests ahead"
                    except Overloaded as full:
                        why = str(full)
                    # Every waiter's own deadline, not only the front one's: behind a long wait at the
                    # front, a later request would otherwise wait as long as that one does.
                    if ticket in self._waiting and time.monotonic() >= deadline:
                        raise Overloaded(f"{why}; waited {wait_s:g} s for room (admission_wait_s)") from None
                    if ticket not in self._waiting:
                        if len(self._waiting) >= self.settings.admission_queue:
                            raise Overloaded(f"{why}; {len(self._waiting)} requests already wait for room "
                                             f"(admission_queue={self.settings.admission_queue})",
                                             retry_after_s=max(1.0, self.settings.admission_wait_s / 2)) from None
                        if self._returning(session_id):  # after the other returning turns, before new sessions
                            self._waiting.insert(sum(1 for t in self._waiting if t in self._turns), ticket)
                            self._turns.add(ticket)
                        else:
                            self._waiting.append(ticket)
                        wait_s = min(wait_s, self.settings.admission_wait_s) if wait_s > 0 else \
                            self.settings.admission_wait_s
                        deadline = time.monotonic() + wait_s
                        log.info("request for session %s waits for KV room (%d waiting)", session_id,
                                 len(self._waiting))
                    if self.draining:
                        raise Draining(f"verifier {self.settings.verifier_id} is shutting down; send the "
                                       f"request to another one")
                    if not is_active():
                        raise Cancelled("the caller went away while waiting for admission")
                    # Woken when a session stops generating; the slice notices a caller that left.
                    self._room.wait(max(0.0, min(0.25, deadline - time.monotonic())))
            finally:
                self._turns.discard(ticket)
                if ticket in self._waiting:
                    self._waiting.remove(ticket)
                    self._room.notify_all()  # the next in line may go now

    def _protect_s(self) -> float:
        """How long after a turn a session is kept from new sessions: twice the 90th percentile of
        the gaps seen between a session's turns here, at most settings.evict_after_idle_s; 0 until
        a few next turns were seen (sessions that never return keep nothing from anyone)."""
        if len(self._gaps) < 4:
            return 0.0
        gaps = sorted(self._gaps)
        return min(self.settings.evict_after_idle_s, 2.0 * gaps[int(0.9 * (len(gaps) - 1))])

    def _returning(self, session_id: str) -> bool:
        """Whether this request is the next turn of a session resident here."""
        sess = self._sessions.get(session_id) if session_id else None
        return sess is not None and not sess.busy

    def _may_try(self, ticket: object, session_id: str) -> bool:
        """Whether a request may try admission now: the first in line, or any returning turn when
        no other returning turn waits before it (new sessions never overtake)."""
        if not self._waiting or self._waiting[0] is ticket:
            return True
        if not self._returning(session_id):
            return False
        ahead = self._waiting.index(ticket) if ticket in self._waiting else len(self._waiting)
        return not any(t in self._turns for t in self._waiting[:ahead])

    def _admit(self, session_id: str, context_len: int, salt: str, key: tuple | None = None,
               context_ids: list[int] | None = None) -> _Session:
        """_checkout's one attempt: caller holds self._lock; raises Overloaded when there is no room."""
        sess = self._sessions.get(session_id) if session_id else None
        if sess is not None and sess.busy:
            raise SessionBusy(f"session {session_id!r} is already generating on this verifier")
        if sess is not None and sess.salt != salt:
            del self._sessions[session_id]
            self._evicted(session_id, sess.seq.ids, sess.salt)
            sess = None
        # Sessions generating at once (a step's rows) and sessions kept resident are two bounds: an
        # idle session costs only its KV, which kv_capacity bounds, so keeping more of them than can
        # run means a conversation between its turns is not evicted for another's new one (64
        # two-turn sessions on 64 slots: 6-7% of second turns prefilled again, speculation's more
        # often than plain decoding's; docs/benchmarks.md). Checked before any eviction: a request
        # that must wait anyway takes nobody's KV.
        generating, cap = self._generating(), self.settings.generating_slots
        if generating >= cap:
            raise Overloaded(f"verifier {self.settings.verifier_id} is full: {generating} sessions generating "
                             f"(max_generating={cap})")
        if sess is None:
            expect = self._expected_share(salt, key, context_ids)
            self._make_room(context_len - expect, exclude=None, protect_s=self._protect_s(), wanted=key)
            if key is not None:
                self._heads.append(key)
            sess = _Session(seq=self.engine.runner.new_sequence(), salt=salt,
                            lost=self._lost.pop(session_id, ()) if session_id else ())
            sess.seq.scope = salt  # its prompt may copy a same-tenant prompt's KV while both prefill
            sess.expect = expect
            if session_id:
                self._sessions[session_id] = sess
            else:
                self._anonymous[id(sess)] = sess
        else:
            self._make_room(context_len - len(sess.seq), exclude=session_id)
            prefix = sess.seq.kv_parts()[1]
            sess.expect = prefix[1] if prefix else 0  # what it reads shared already
            self._sessions.move_to_end(session_id)
            self._gaps.append(time.monotonic() - sess.last_used)
        sess.busy = True
        sess.reserved = context_len
        sess.last_used = time.monotonic()
        return sess

    def _expected_share(self, salt: str, key: tuple | None, context_ids: list[int] | None) -> int:
        """Of a new session's context, what it will read from an idle resident session's shared
        prefix (`_share_prefix`), so admission reserves only the rest: 64 agent sessions each
        reserving the whole 1,260-token tool list they share would wait for room they never use.
        Caller holds self._lock."""
        if key is None or not context_ids:
            return 0
        return max((other.seq.shareable(context_ids) for other in self._sessions.values()
                    if not other.busy and other.salt == salt and prefix_key(other.salt, other.seq.ids) == key),
                   default=0)

    def _share_prefix(self, sess: _Session, context_ids: list[int]) -> int:
        """Copy the KV of the longest prefix of `context_ids` that another resident session of the
        same tenant holds into `sess` (`Sequence.share_longest`). Returns the tokens copied."""
        # Only idle donors, and the copy under the table lock: a donor cannot be checked out (and
        # roll its cache back) while we read it.
        with self._lock:
            donors = (other.seq for other in self._sessions.values()
                      if other is not sess and not other.busy and other.salt == sess.salt)
            shared = sess.seq.share_longest(donors, context_ids)
            if not shared and not len(sess.seq) and len(context_ids) > 256:
                log.debug("no donor for a new %d-token context: %d idle sessions of its tenant", len(context_ids),
                          sum(1 for o in self._sessions.values() if not o.busy and o.salt == sess.salt))
        if shared:
            self.metrics.shared(shared)
        return shared

    def _make_room(self, new_tokens: int, exclude: str | None, protect_s: float = 0.0,
                   wanted: tuple | None = None) -> list[tuple[str, list[int], str]]:
        """Evict idle sessions, least recently used first, until the budget holds `new_tokens`
        more; none idle for less than `protect_s`; the last idle holder of a prefix in use (see
        below; `wanted`: the prefix key of the session being admitted) only when nothing else
        frees room. Raises Overloaded, evicting nobody, when evicting every candidate would not
        make room (the request waits, and the sessions stay: an attempt that failed once evicted
        them all for nothing, donors of the waiting requests' prefix among them). Caller holds
        self._lock."""
        live = self._live()
        used, count = _kv_used(live), len(live) + (1 if exclude is None else 0)
        recent = time.monotonic() - protect_s

        # A prefix that generating sessions share (a tool list, a system prompt) keeps one idle
        # holder while the others can go: the next session of that prefix copies it from there
        # rather than computing it (64 agent sessions: 20k of 21k computed prefill tokens were the
        # tool list again, computed by sessions that found every holder busy). Only when nothing
        # else frees room does the last holder go too. In use: a generating session's prefix, the
        # arriving session's, one that sessions lately admitted here began with more than once.
        in_use = {key for key, n in Counter(self._heads).items() if n > 1} | ({wanted} if wanted else set())
        idle_holders: Counter[tuple] = Counter()
        keys = {id(sess): prefix_key(sess.salt, sess.seq.ids) for sess in live}
        for sess in live:
            key = keys[id(sess)]
            if key is not None:
                if sess.busy:
                    in_use.add(key)
                else:
                    idle_holders[key] += 1
        candidates = [sid for sid, sess in self._sessions.items()
                      if sid != exclude and not sess.busy and not (protect_s and sess.last_used > recent)]
        first, last_holders = [], []
        for sid in candidates:
            key = keys[id(self._sessions[sid])]
            if key in in_use and idle_holders[key] == 1:
                last_holders.append(sid)
            else:
                first.append(sid)
                if key is not None:
                    idle_holders[key] -= 1
        # The arriving session's own prefix is not evicted for it (it would copy from there) while
        # a generating session will free room; with none, waiting could not help.
        keep_wanted = wanted is not None and any(s.busy for s in live)
        order = first + [sid for sid in last_holders if not keep_wanted or keys[id(self._sessions[sid])] != wanted]
        gone = {id(self._sessions[sid]) for sid in order}
        if (_kv_used(s for s in live if id(s) not in gone) + new_tokens > self.kv_capacity
                or count - len(order) > self.settings.max_sessions):
            raise Overloaded(
                f"verifier {self.settings.verifier_id} is full: KV budget "
                f"{self.kv_capacity} tokens / {self.settings.max_sessions} sessions "
                f"in use by active sessions"
            )
        evicted = []
        for sid in order:
            if used + new_tokens <= self.kv_capacity and count <= self.settings.max_sessions:
                break
            sess = self._sessions.pop(sid)
            # what it frees: its own tokens, and a shared prefix only with its last reader
            used, count = _kv_used(self._live()), count - 1
            evicted.append((sid, sess.seq.ids, sess.salt))
            self._lost[sid] = array("i", sess.seq.ids)
            while len(self._lost) > LOST_REMEMBERED:
                self._lost.popitem(last=False)
            self.metrics.eviction()
            log.info("evicted idle session %s (%d tokens) to make room", sid, len(sess.seq))
        for sid, ids, salt in evicted:
            self._evicted(sid, ids, salt)
        return evicted

    def _evicted(self, sid: str, ids: list[int], salt: str) -> None:
        if self.publisher is not None:
            self.publisher.evict_session(sid, ids, salt)

    def _release(self, session_id: str, sess: _Session, keep: bool) -> None:
        with self._lock:
            self._room.notify_all()  # an idle session can be evicted: room for a waiting request
            sess.busy = False
            sess.last_used = time.monotonic()
            self._anonymous.pop(id(sess), None)  # its KV goes with it
            if session_id and not keep and self._sessions.get(session_id) is sess:
                del self._sessions[session_id]
                self._evicted(session_id, sess.seq.ids, sess.salt)
        if session_id and keep and self.publisher is not None:
            self.publisher.publish_session(session_id, self.settings.verifier_id, sess.seq.ids, sess.salt)

    def generate(
        self,
        session_id: str,
        context_ids: list[int],
        sampling: SamplingParams,
        spec: SpecConfig,
        drafter_address: str = "",
        *,
        is_active: Callable[[], bool] = lambda: True,
        headers: tuple = (),
        cache_salt: str = "",
        resumed_tokens: int = 0,
        admission_wait_s: float = 0.0,
    ) -> Iterator[StepOutput | GenerationResult]:
        """Run one request: yields a StepOutput per target step, then the GenerationResult.
        `cache_salt`: the isolation domain of the session's KV (SessionGenerateRequest.cache_salt);
        `resumed_tokens`: the context's tail that is this request's output from before a failover;
        `admission_wait_s`: the caller's longest wait for KV room (0: settings.admission_wait_s)."""
        status = "cancelled"  # unless it finishes or fails: the consumer stopped early
        if len(cache_salt.encode()) > MAX_SALT_BYTES:
            raise InvalidRequest(f"cache_salt is longer than {MAX_SALT_BYTES} bytes")
        if self.draining:
            raise Draining(f"verifier {self.settings.verifier_id} is shutting down; send the request to another one")
        steps = self._generate(session_id, context_ids, sampling, spec, drafter_address,
                               is_active=is_active, headers=headers, cache_salt=cache_salt,
                               resumed_tokens=resumed_tokens, admission_wait_s=admission_wait_s)
        with session_context(session_id), contextlib.closing(steps):
            try:
                for item in steps:
                    if isinstance(item, GenerationResult):
                        ok = item.finish_reason in (FinishReason.stop, FinishReason.length)
                        status = "ok" if ok else item.finish_reason.value
                    yield item
            except Exception as exc:
                status = status_of(exc)
                raise
            finally:
                self.metrics.request(status)

    def _generate(
        self,
        session_id: str,
        context_ids: list[int],
        sampling: SamplingParams,
        spec: SpecConfig,
        drafter_address: str,
        *,
        is_active: Callable[[], bool],
        headers: tuple,
        cache_salt: str,
        resumed_tokens: int = 0,
        admission_wait_s: float = 0.0,
    ) -> Iterator[StepOutput | GenerationResult]:
        self.validate(context_ids, sampling)
        if not 0 <= resumed_tokens < len(context_ids):
            raise InvalidRequest(f"resumed_tokens is {resumed_tokens}; it must be below the context's "
                                 f"{len(context_ids)} tokens")
        drafter_address = self.allowed_drafter(drafter_address)  # before any state changes or connections
        sess = self._checkout(session_id, len(context_ids), cache_salt, is_active,
                              key=prefix_key(cache_salt, context_ids), wait_s=admission_wait_s,
                              context_ids=context_ids)
        proposer = None
        keep, released = True, False
        try:
            self._share_prefix(sess, list(context_ids))
            # Prompt lookup runs here, drafter or not: the same algorithm on the same ids in tens of
            # microseconds, where a drafter would add a round trip and messages every step (see
            # docs/history.md, "prompt lookup on the verifier").
            remote = spec.strategy not in (DraftStrategy.none, DraftStrategy.ngram)
            if remote and drafter_address and self.connector is not None:
                proposer = RemoteProposer(
                    self.connector, drafter_address, session_id or uuid.uuid4().hex, sampling, spec,
                    self.target.vocab_size, wait_s=self.settings.draft_wait_ms / 1000.0,
                    retry_s=self.settings.drafter_retry_s, headers=headers,
                    others_busy=lambda: self.executor.busy_sessions > 1,
                    # hybrid: prompt lookup when the drafter's block is late; suffix: the session's
                    # own index, drafted here first (drafting.py: the store's part needs the drafter)
                    local=(self.engine.factory.build(spec.model_copy(update={"strategy": DraftStrategy.ngram}))
                           if spec.strategy == DraftStrategy.hybrid else
                           self.engine.factory.build(spec) if spec.strategy == DraftStrategy.suffix else None),
                    local_first=spec.strategy == DraftStrategy.suffix,
                    target_model=self.target.model_id, cache_scope=scope_of(cache_salt),
                    token_trees=trees_allowed(self.engine.runner, sampling),
                )
                proposer.open(list(context_ids))  # the drafter starts while we prefill
            elif spec.strategy != DraftStrategy.none:
                # No drafter (none configured, or none offering the strategy at the gateway's last
                # look, e.g. one restarting or too busy to answer): the strategies that need no model
                # run here (suffix decoding over the session's own tokens only; the cross-session
                # store lives on the drafters), and so does a draft model where this verifier has
                # one. Without one, hybrid drafts with prompt lookup (its own fallback when the
                # drafter is late) and model decodes plainly: the same text, never an error.
                if spec.strategy in (DraftStrategy.ngram, DraftStrategy.suffix) or self.engine.factory.draft_model is not None:
                    proposer = self.engine.factory.build(spec)
                elif spec.strategy == DraftStrategy.hybrid:
                    proposer = self.engine.factory.build(spec.model_copy(update={"strategy": DraftStrategy.ngram}))
                else:
                    spec = spec.model_copy(update={"strategy": DraftStrategy.none})
            with tracer.start_as_current_span("prefill") as span:
                # Prefill and every step go through the runner's batch executor: the forwards of
                # concurrent sessions run as one batch (continuous batching).
                gen = self.engine.start(context_ids, sampling, spec, sequence=sess.seq, proposer=proposer,
                                        resumed=resumed_tokens)
                reused, computed = gen.stats.prefill_reused_tokens, gen.stats.prefill_computed_tokens
                self.metrics.prefill(reused, computed)
                if gen.prefill_copied:
                    self.metrics.shared(gen.prefill_copied)
                if sess.lost:  # the tokens it held before an eviction, less what was copied back
                    self.metrics.recomputed(max(0, min(common_prefix_len(sess.lost, context_ids), reused + computed)
                                                - reused))
                    sess.lost = ()
                span.set_attributes({
                    "tandem.session_id": session_id, "tandem.context_tokens": len(context_ids),
                    "tandem.prefill.reused_tokens": reused, "tandem.prefill.computed_tokens": computed,
                    "tandem.strategy": spec.strategy.value, "tandem.drafter": drafter_address,
                })
            with self._lock:
                self._running += 1
            # From here the step loop runs the generation (plan, forward, verify, commit, with every
            # other session's step); this handler only reads its steps and stops it.
            entry = self.executor.attach(gen)
            faults = (0, 0)
            streamed = 0
            try:
                while not (self._cut.is_set() or not is_active()):
                    rec = entry.next(STEP_POLL_S)  # raises what failed the generation
                    if rec is None:
                        if entry.done:
                            break
                        continue
                    step = rec.output
                    # The step as it ran in the loop: its span has the loop's times, this request's parent.
                    span = tracer.start_span("verify_step", start_time=rec.start_ns)
                    self._observe(span, step, faults, max(1, rec.batch_size), proposer)
                    span.end(end_time=rec.end_ns)
                    faults = step.faults
                    streamed += len(step.tokens)
                    yield step
            finally:
                entry.stop()  # the loop lets go before anyone touches the sequence again
                with self._lock:
                    self._running -= 1
            if not gen.finished:
                gen.cancel()  # the client left, or the drain grace ended
                if self._cut.is_set():
                    raise Draining(
                        f"verifier {self.settings.verifier_id} is shutting down and cut this stream after "
                        f"{streamed} tokens (its drain grace ended); continue it on another verifier")
            result = gen.result()
            self.metrics.faults(result.stats.fallback_steps, result.stats.rejected_blocks)
            # The session is idle before its last message leaves: the client may send the next turn
            # the moment it reads it, sooner than this generator is resumed to finish (64 sessions
            # on 2 cores: a next turn once found its session still marked busy and failed).
            if proposer is not None:
                proposer.close("finished")
            self._release(session_id, sess, gen_ok(sess))
            released = True
            yield result
        except GeneratorExit:
            raise  # the client went away between steps: the session's state is consistent, keep it
        except BaseException:
            # A failed or abandoned step may leave the cache ahead of the committed ids: drop the
            # session rather than trust it (its history lives in the gateway).
            keep = False
            raise
        finally:
            if not released:
                if proposer is not None:
                    proposer.close("finished" if keep else "cancelled")
                self._release(session_id, sess, keep and gen_ok(sess))

    def _observe(self, span, step: StepOutput, faults_before: tuple[int, int], batch_size: int, proposer) -> None:
        """One verify step to the metrics and its span (in docs/design.md's terms); a drafter fallback
        or rejected blocks during the step become span events."""
        self.metrics.step(step.drafted, step.accepted, len(step.tokens), batch_size, step.proposer)
        if not span.is_recording():
            return
        span.set_attributes({
            "tandem.block_len": step.block_len,  # drafts asked for (0 = a planned plain step)
            "tandem.proposer": step.proposer or "none",
            "tandem.drafted": step.drafted,
            "tandem.accepted": step.accepted,
            "tandem.recovered": int(step.accepted < step.drafted),
            "tandem.bonus": int(step.accepted == step.drafted),
            "tandem.committed": step.accepted + 1,  # accepted drafts + the recovered or bonus token
            "tandem.emitted": len(step.tokens),  # committed tokens streamed (fewer at a stop or the limit)
            "tandem.batch_size": batch_size,
            "tandem.first_index": step.first_index,
        })
        fallback, rejected = step.faults
        if fallback > faults_before[0]:
            span.add_event("drafter_fallback", {"tandem.proposer": proposer.name,
                                                "tandem.fallback_steps": fallback})
        if rejected > faults_before[1]:
            span.add_event("draft_blocks_rejected", {"tandem.rejected_blocks": rejected})


def gen_ok(sess: _Session) -> bool:
    """The session's cache is consistent with its committed tokens (holds exactly ids[:-1])."""
    return sess.seq.cached_len == max(len(sess.seq.ids) - 1, 0)


__all__ = [
    "FinishReason",
    "Cancelled",
    "Draining",
    "InvalidRequest",
    "Overloaded",
    "SessionBusy",
    "VerifierCore",
]
