"""The drafter's gRPC face: a thin servicer over `DrafterCore`, health checking, reflection.

Error policy of the Draft stream. A bidi stream ends with one status, but it multiplexes sessions,
so an error about one session must not end the others:
- An Open, Commit or Close that fails (InvalidRequest -> INVALID_ARGUMENT, fields the conversion
  cannot read included, e.g. an unknown strategy number or a NaN temperature, and a session that
  would outgrow DrafterSettings.max_context_tokens; UnknownSession -> NOT_FOUND, Overloaded ->
  RESOURCE_EXHAUSTED, anything unexpected -> INTERNAL) drops that session:
  its draft state is freed, nothing is sent for it, the reason is logged with the session id and
  counted in `DrafterCore.stats()["session_errors"]` under the status name. The stream goes on.
  The verifier sees no block for the session and decodes it plainly (a drafter changes speed, never
  text); later Commits for it are dropped as NOT_FOUND (logged at debug level) until it is re-opened.
- A message that names no session cannot be attributed, so it means a broken peer: the stream
  ends with INVALID_ARGUMENT, which closes all its sessions.
- When the stream ends (half-close, cancellation, deadline, server stop), all its sessions close.
Status codes are chosen in one place, `status_for`.

Flow on a stream: a reader thread takes the verifier's messages as they come and queues each on
its session's lane; lanes run on a shared pool (DrafterSettings.draft_workers), one message of a
session at a time and in order, so the blocks of a fast session (prompt lookup, microseconds) never
wait behind a slow one's (a draft model's block), and the stream is always read. Blocks go out in
the order they are ready.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import uuid
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health

from tandem.contract.params import DraftStrategy, SamplingParams
from tandem.serving.logs import session_context
from tandem.serving.messages import DraftBlock
from tandem.serving.metrics import DrafterMetrics
from tandem.services.drafter.core import (
    DrafterCore,
    InvalidRequest,
    Overloaded,
    UnknownSession,
)
from tandem.services.drafter.settings import DrafterSettings
from tandem.serving.grpc_server import build_server as build_grpc_server, handler_thread
from tandem.serving.protoconv import (
    draft_block_to_proto,
    drafter_info_to_proto,
    sampling_from_proto,
    strategy_from_proto,
    strategy_name,
)
from tandem.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("tandem.drafter")

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name  # "tandem.v1.Drafter"
DEFAULT_ADDRESS = "0.0.0.0:50052"

_STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownSession: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The one mapping from domain errors to gRPC status codes."""
    for kind, code in _STATUS.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


@dataclass
class _StreamStats:
    """What one Draft stream carried, logged when it ends."""

    sessions: int = 0
    regular_blocks: int = 0
    speculative_blocks: int = 0
    errors: Counter = field(default_factory=Counter)  # status name -> failed messages


_WAKE = object()  # a stream's reader or a lane ended: the sender checks whether the stream is done


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, core: DrafterCore):
        self.core = core
        # (no OpenMP pools on the workers: the draft model runs on its own thread, tandem.engine.native.threads)
        self._pool = ThreadPoolExecutor(max_workers=core.settings.draft_workers, thread_name_prefix="draft",
                                        initializer=handler_thread)

    def Draft(
        self, request_iterator: Iterator[drafter_pb2.DraftRequest], context: grpc.ServicerContext
    ) -> Iterator[drafter_pb2.DraftBlock]:
        owner = uuid.uuid4().hex  # the stream's sessions are keyed under it
        stats = _StreamStats()
        dropped: set[str] = set()  # sessions dropped on this stream (quiet follow-up errors)
        out: queue.Queue = queue.Queue()  # blocks ready to send, _WAKE, or an abort (code, message)
        # A session's lane: its messages not yet handled. A lane exists exactly while a worker runs
        # it (the worker removes it when it finds it empty), so len(lanes) is the workers busy.
        lanes: dict[str, deque] = {}
        lock = threading.Lock()
        state = {"reading": True, "ended": False}

        def end() -> int:
            """The stream is over: free its sessions. A lane still running an `open` when this runs
            closes what it opened itself (work() checks `ended` after each message), so no session
            outlives its stream (`make fuzz` found one that did). Idempotent."""
            with lock:
                state["ended"] = True
            return self.core.close_owner(owner)

        # A cancelled stream may never resume this generator (so `finally` would wait for garbage
        # collection): the termination callback frees its sessions at once.
        context.add_callback(end)

        def work(sid: str) -> None:
            while True:
                with lock:
                    if not lanes[sid]:
                        del lanes[sid]
                        out.put(_WAKE)
                        return
                    request = lanes[sid].popleft()
                with session_context(sid):  # log lines name the session
                    try:
                        for block in self._dispatch(request, owner, stats):
                            if block.speculative:
                                stats.speculative_blocks += 1
                            else:
                                stats.regular_blocks += 1
                            out.put(draft_block_to_proto(block))
                        if request.WhichOneof("kind") == "open":
                            dropped.discard(sid)
                    except Exception as exc:  # noqa: BLE001 - one session's failure must not end the stream
                        try:
                            self._drop(sid, owner, exc, stats, dropped)
                        except Exception:  # noqa: BLE001 - the lane must finish, or the stream never ends
                            log.exception("dropping draft session %s failed", sid)
                    with lock:
                        ended = state["ended"]
                    if ended:  # the stream ended while this message ran: nothing of it stays open
                        self.core.close(sid, owner=owner)

        def read() -> None:
            try:
                for request in request_iterator:
                    sid = request.session_id
                    if not sid:
                        exc = InvalidRequest("DraftRequest without session_id: the stream cannot be attributed")
                        out.put((status_for(exc), str(exc)))
                        return
                    with lock:
                        if sid in lanes:
                            lanes[sid].append(request)
                        else:
                            lanes[sid] = deque([request])
                            self._pool.submit(work, sid)
            except Exception as exc:  # noqa: BLE001 - the stream broke (cancelled, reset): it ends
                log.debug("draft stream read ended: %s", exc)
            finally:
                with lock:
                    state["reading"] = False
                out.put(_WAKE)

        threading.Thread(target=read, daemon=True, name="draft-read").start()
        try:
            while True:
                item = out.get()
                if item is _WAKE:
                    with lock:
                        if not state["reading"] and not lanes and out.empty():
                            return
                    continue
                if isinstance(item, tuple):
                    context.abort(*item)
                yield item
        finally:
            left_open = end()
            core = self.core.stats()
            log.info(
                "draft stream ended: %d opens (%d sessions closed at the end), %d regular + %d "
                "speculative blocks, errors %s; drafter so far: %d/%d speculative blocks used, "
                "overlap hid %.0f%% of %.1f ms drafting",
                stats.sessions, left_open, stats.regular_blocks, stats.speculative_blocks, dict(stats.errors),
                core["speculative_used"], core["speculative_blocks"], 100 * core["hidden_fraction"],
                1e3 * core["draft_seconds"],
            )

    def _drop(self, sid: str, owner: str, exc: Exception, stats: _StreamStats, dropped: set[str]) -> None:
        """The stream's per-session error policy (module docstring): free, count, log, go on."""
        code = status_for(exc)
        stats.errors[code.name] += 1
        self.core.close(sid, owner=owner, error=code.name)
        if code == grpc.StatusCode.INTERNAL:
            log.error("draft session %s dropped (INTERNAL)", sid, exc_info=exc)
        elif sid in dropped:
            log.debug("draft session %s (already dropped): %s: %s", sid, code.name, exc)
        else:
            log.warning("draft session %s dropped (%s): %s", sid, code.name, exc)
        dropped.add(sid)

    def _dispatch(self, request: drafter_pb2.DraftRequest, owner: str, stats: _StreamStats) -> Iterator[DraftBlock]:
        sid, kind = request.session_id, request.WhichOneof("kind")
        if kind == "open":
            msg = request.open
            blocks = self.core.open(
                sid,
                list(msg.context_ids),
                _strategy_from_pb(sid, msg.strategy),
                msg.max_draft_tokens,
                _sampling_from_pb(sid, msg.sampling),
                msg.vocab_size,
                msg.next_block_len,
                owner=owner,
                target_model=msg.target_model,
                cache_scope=msg.cache_scope,
                token_trees=msg.token_trees,
                trace_context=dict(msg.trace_context),
            )
            stats.sessions += 1
            return blocks
        if kind == "commit":
            msg = request.commit
            return self.core.commit(sid, msg.committed_len, list(msg.appended_ids), msg.next_block_len, owner=owner)
        if kind == "close":
            self.core.close(sid, owner=owner, finished=request.close.reason == "finished")
            return iter(())
        raise InvalidRequest(f"DraftRequest for session {sid} carries no open, commit or close")

    def GetInfo(
        self, request: drafter_pb2.DrafterInfoRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.DrafterInfo:
        return drafter_info_to_proto(self.core.info())


def _strategy_from_pb(session_id: str, strategy: int) -> DraftStrategy:
    try:
        drafted = strategy_from_proto(strategy)
    except ValueError as exc:  # a number this build does not know
        raise InvalidRequest(f"session {session_id}: {exc}") from None
    if drafted in (None, DraftStrategy.none):
        raise InvalidRequest(
            f"session {session_id}: strategy {strategy_name(strategy)} cannot be drafted "
            "(NGRAM, MODEL or HYBRID; the verifier resolves the default before opening)"
        )
    return drafted


def _sampling_from_pb(session_id: str, msg: common_pb2.SamplingParams) -> SamplingParams:
    try:
        return sampling_from_proto(msg)
    except ValueError as exc:
        raise InvalidRequest(f"session {session_id}: {exc}") from None


# Who may call what, with mutual TLS (docs/security.md, "Roles between services"): drafts go to
# verifiers only (a draft stream carries a session's tokens); a gateway polls GetInfo for routing.
ROLES = {f"/{SERVICE_NAME}/Draft": ("verifier",), f"/{SERVICE_NAME}/GetInfo": ("verifier", "gateway")}


def _build(
    core: DrafterCore, address: str, max_workers: int, health_address: str | None = None
) -> tuple[grpc.Server, int, health.HealthServicer]:
    # Each open Draft stream holds one worker thread for its lifetime (its sender; a reader and
    # the lanes' pool do the rest). A verifier keeps one stream per drafter, so max_workers bounds
    # the verifiers (and older per-session clients) served at once, with room for GetInfo and health.
    servicer = DrafterServicer(core)
    return build_grpc_server(
        lambda server: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server),
        [SERVICE_NAME], address, max_workers=max_workers, tls=core.settings.tls, health_address=health_address,
        roles=ROLES,
    )


def build_server(core: DrafterCore, address: str = "127.0.0.1:0", max_workers: int = 16) -> tuple[grpc.Server, int]:
    """A drafter server bound to `address` (port 0 picks a free port), not yet started: call
    `server.start()`, and `server.stop(grace)` to end it (streams still open get `grace` seconds,
    then are cancelled, which frees their sessions)."""
    server, port, _ = _build(core, address, max_workers)
    return server, port


def serve(
    settings: DrafterSettings,
    address: str = DEFAULT_ADDRESS,
    *,
    max_workers: int = 16,
    grace_s: float = 5.0,
    stop: threading.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Run a drafter until SIGTERM/SIGINT (or `stop` is set), then stop gracefully: health turns
    NOT_SERVING first so load balancers move away, then open streams get `grace_s` seconds.
    Signal handlers are installed only when called from the main thread. `on_ready(port)` runs
    once the server accepts calls."""
    core = DrafterCore(settings)
    metrics = DrafterMetrics(core.stats)
    if settings.metrics_port is not None:
        metrics.serve(settings.metrics_port, address.rpartition(":")[0].strip("[]") or "0.0.0.0")
    host = address.rpartition(":")[0]
    health = None if settings.health_port is None else f"{host}:{settings.health_port}"
    server, port, health_servicer = _build(core, address, max_workers, health)
    stop = stop or threading.Event()
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    server.start()
    info = core.info()
    log.info(
        "drafter %s serving on port %d: strategies %s%s",
        info.drafter_id, port, [s.value for s in info.strategies],
        f", draft model {info.model_id}" if info.model_id else "",
    )
    try:
        if on_ready is not None:
            on_ready(port)
        stop.wait()
    finally:
        log.info("drafter %s stopping (grace %.1f s)", info.drafter_id, grace_s)
        health_servicer.enter_graceful_shutdown()
        server.stop(grace_s).wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info("drafter %s stopped: %s", info.drafter_id, core.stats())
