"""The verifier's domain object: the target model, its sessions' KV caches and their decode loops.

No gRPC here (the servicer in server.py translates); the remote drafter is reached through
`RemoteProposer`, which the loop sees as any other proposer.

Sessions: a request with a session id reuses that session's KV cache (its `Sequence`): a later turn
sends the whole conversation, the longest resident prefix is kept and only the new tokens are
prefilled. Idle sessions are evicted least-recently-used when the KV budget (tokens) or the session
limit is exceeded; every change is mirrored in Redis by the residency publisher.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tandem.config import DraftStrategy, SamplingParams, SpecConfig
from tandem.models import LoadedModel
from tandem.runner import Sequence
from tandem.spec import Engine, FinishReason, GenerationResult, StepOutput

from .remote import ChannelPool, RemoteProposer
from .settings import VerifierSettings

log = logging.getLogger("tandem.verifier")


class InvalidRequest(ValueError):
    """The request cannot be served as asked; the message says why (INVALID_ARGUMENT)."""


class SessionBusy(RuntimeError):
    """Another request of the same session is still generating (ABORTED: retry after it ends)."""


class Overloaded(RuntimeError):
    """No KV budget or session slot is free (RESOURCE_EXHAUSTED, with a retry hint)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class _Session:
    seq: Sequence
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class VerifierCounters:
    requests: int = 0
    prefill_reused_tokens: int = 0
    prefill_computed_tokens: int = 0
    evictions: int = 0
    fallback_steps: int = 0
    rejected_blocks: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0


class VerifierCore:
    def __init__(
        self,
        settings: VerifierSettings,
        target: LoadedModel,
        *,
        publisher=None,  # tandem.residency.ResidencyPublisher or None
    ):
        self.settings = settings
        self.target = target
        self.engine = Engine(target, None, SpecConfig(max_draft_tokens=settings.max_draft_tokens))
        self.publisher = publisher
        self.channels = ChannelPool()
        self.counters = VerifierCounters()
        self.address = settings.advertise_address or f"{settings.host}:{settings.port}"
        self._runner_lock = threading.Lock()  # one forward at a time: the runner is not thread-safe
        self._lock = threading.Lock()  # guards the session table
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, address: str | None = None) -> None:
        if address:
            self.address = address
        if self.publisher is not None:
            self.publisher.register(self.info())
            self._heartbeat = threading.Thread(target=self._beat, daemon=True, name="heartbeat")
            self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            self.publisher.heartbeat(self.info())

    def stop(self) -> None:
        self._stop.set()
        if self.publisher is not None:
            with self._lock:
                sessions = list(self._sessions.items())
            for sid, sess in sessions:
                self.publisher.evict_session(sid, sess.seq.ids)
            self.publisher.deregister(self.settings.verifier_id)
        self.channels.close()

    # -- queries --------------------------------------------------------------------------------

    def kv_used_tokens(self) -> int:
        with self._lock:
            return sum(len(s.seq) for s in self._sessions.values())

    def info(self) -> dict:
        with self._lock:
            active = sum(1 for s in self._sessions.values() if s.busy)
            used = sum(len(s.seq) for s in self._sessions.values())
            resident = len(self._sessions)
        return {
            "verifier_id": self.settings.verifier_id,
            "address": self.address,
            "model_id": self.target.model_id,
            "vocab_size": self.target.vocab_size,
            "max_context_tokens": self.target.max_context,
            "kv_capacity_tokens": self.settings.kv_capacity_tokens,
            "kv_used_tokens": used,
            "active_sessions": active,
            "resident_sessions": resident,
            "eos_token_ids": self.target.eos_token_ids,
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
        if len(context_ids) >= self.target.max_context:
            raise InvalidRequest(
                f"context of {len(context_ids)} tokens does not fit the context window of "
                f"{self.target.max_context} tokens of {self.target.model_id}"
            )

    def _checkout(self, session_id: str, context_len: int) -> _Session:
        """The session's resident state (created if new), marked busy; evicts idle sessions LRU to
        make room."""
        with self._lock:
            sess = self._sessions.get(session_id) if session_id else None
            if sess is not None and sess.busy:
                raise SessionBusy(f"session {session_id!r} is already generating on this verifier")
            if sess is None:
                sess = _Session(seq=self.engine.runner.new_sequence())
                if session_id:
                    self._make_room(context_len, exclude=None)
                    self._sessions[session_id] = sess
            else:
                self._sessions.move_to_end(session_id)
                self._make_room(context_len - len(sess.seq), exclude=session_id)
            sess.busy = True
            sess.last_used = time.monotonic()
            return sess

    def _make_room(self, new_tokens: int, exclude: str | None) -> list[tuple[str, list[int]]]:
        """Evict idle sessions, least recently used first, until the budget holds `new_tokens`
        more. Caller holds self._lock."""
        evicted = []

        def over() -> bool:
            used = sum(len(s.seq) for s in self._sessions.values())
            return (used + new_tokens > self.settings.kv_capacity_tokens
                    or len(self._sessions) + (1 if exclude is None else 0) > self.settings.max_sessions)

        for sid in list(self._sessions):
            if not over():
                break
            sess = self._sessions[sid]
            if sid == exclude or sess.busy:
                continue
            del self._sessions[sid]
            evicted.append((sid, sess.seq.ids))
            self.counters.evictions += 1
            log.info("evicted idle session %s (%d tokens) to make room", sid, len(sess.seq))
        if over():
            for sid, ids in evicted:  # keep what we evicted evicted: it is gone from memory already
                self._evicted(sid, ids)
            raise Overloaded(
                f"verifier {self.settings.verifier_id} is full: KV budget "
                f"{self.settings.kv_capacity_tokens} tokens / {self.settings.max_sessions} sessions "
                f"in use by active sessions"
            )
        for sid, ids in evicted:
            self._evicted(sid, ids)
        return evicted

    def _evicted(self, sid: str, ids: list[int]) -> None:
        if self.publisher is not None:
            self.publisher.evict_session(sid, ids)

    def _release(self, session_id: str, sess: _Session, keep: bool) -> None:
        with self._lock:
            sess.busy = False
            sess.last_used = time.monotonic()
            if session_id and not keep and self._sessions.get(session_id) is sess:
                del self._sessions[session_id]
                self._evicted(session_id, sess.seq.ids)
        if session_id and keep and self.publisher is not None:
            self.publisher.publish_session(session_id, self.settings.verifier_id, sess.seq.ids)

    def generate(
        self,
        session_id: str,
        context_ids: list[int],
        sampling: SamplingParams,
        spec: SpecConfig,
        drafter_address: str = "",
        *,
        is_active: Callable[[], bool] = lambda: True,
        metadata: tuple = (),
    ) -> Iterator[StepOutput | GenerationResult]:
        """Run one request: yields a StepOutput per target step, then the GenerationResult."""
        self.validate(context_ids, sampling)
        self.counters.requests += 1
        sess = self._checkout(session_id, len(context_ids))
        proposer = None
        keep = True
        try:
            if spec.strategy != DraftStrategy.none and drafter_address:
                proposer = RemoteProposer(
                    self.channels.get(drafter_address), session_id or uuid.uuid4().hex, sampling, spec,
                    self.target.vocab_size, wait_s=self.settings.draft_wait_ms / 1000.0,
                    retry_s=self.settings.drafter_retry_s, metadata=metadata,
                )
                proposer.open(list(context_ids))  # the drafter starts while we prefill
            elif spec.strategy != DraftStrategy.none:
                proposer = self.engine.factory.build(spec) if spec.strategy == DraftStrategy.ngram else None
            with self._runner_lock:
                gen = self.engine.start(context_ids, sampling, spec, sequence=sess.seq, proposer=proposer)
            while not gen.finished:
                if not is_active():
                    gen.cancel()
                    break
                with self._runner_lock:
                    step = gen.step()
                yield step
            result = gen.result()
            self._count(result)
            yield result
        except GeneratorExit:
            raise  # the client went away between steps: the session's state is consistent, keep it
        except BaseException:
            # A failed or abandoned step may leave the cache ahead of the committed ids: drop the
            # session rather than trust it (its history lives in the gateway).
            keep = False
            raise
        finally:
            if proposer is not None:
                proposer.close("finished" if keep else "cancelled")
            self._release(session_id, sess, keep and gen_ok(sess))

    def _count(self, result: GenerationResult) -> None:
        c, s = self.counters, result.stats
        c.prefill_reused_tokens += s.prefill_reused_tokens
        c.prefill_computed_tokens += s.prefill_computed_tokens
        c.fallback_steps += s.fallback_steps
        c.rejected_blocks += s.rejected_blocks
        c.drafted += s.drafted
        c.accepted += s.accepted
        c.steps += s.steps


def gen_ok(sess: _Session) -> bool:
    """The session's cache is consistent with its committed tokens (holds exactly ids[:-1])."""
    return sess.seq.cached_len == max(len(sess.seq.ids) - 1, 0)


__all__ = [
    "FinishReason",
    "InvalidRequest",
    "Overloaded",
    "SessionBusy",
    "VerifierCore",
]
