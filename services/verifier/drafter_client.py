"""The gRPC implementation of the verifier's `DrafterConnector` (drafting.py): one channel and one
`Drafter.Draft` stream per drafter address, carrying every session this verifier drafts there,
and one thread per stream that hands each block to its session's link.

Everything gRPC-shaped stays here; what crosses into the core is drafting.py's domain objects,
converted by tandem.serving.protoconv.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import grpc
from opentelemetry import context as otel_context

from tandem.serving.protoconv import draft_block_from_proto, draft_open_to_proto
from tandem.serving.tls import DRAFTER_NAME, TlsConfig, channel_credentials, channel_options
from tandem.v1 import drafter_pb2, drafter_pb2_grpc

from tandem.serving.messages import DraftBlock, DraftSessionOpen

from .drafting import DrafterUnavailable

log = logging.getLogger("tandem.verifier.drafter_client")

_END = object()  # sentinel that ends a stream's request iterator
TRACE_KEYS = ("traceparent", "tracestate")  # the request's W3C context, sent in OpenSession


class _DraftStream:
    """One `Draft` stream to one drafter with the sessions it carries. Requests go through a queue
    the call iterates; a daemon thread reads blocks and gives each to its session's link. When the
    stream breaks every link learns it (on_lost) and the next open starts a new stream."""

    def __init__(self, stub: drafter_pb2_grpc.DrafterStub, address: str,
                 on_dead: Callable[["_DraftStream"], None]):
        self.address = address
        self._requests: queue.Queue = queue.Queue()
        self._links: dict[str, "_GrpcDraftLink"] = {}
        self._lock = threading.Lock()
        self._on_dead = on_dead
        self.dead = False
        # The stream outlives every request: it starts outside any request's trace (each session's
        # own context travels in its OpenSession).
        token = otel_context.attach(otel_context.Context())
        try:
            self._call = stub.Draft(self._request_iter())
        except grpc.RpcError as exc:  # creation itself rarely fails; the stream reports errors
            raise DrafterUnavailable(str(exc)) from None
        finally:
            otel_context.detach(token)
        threading.Thread(target=self._receive, daemon=True, name=f"draft-recv-{address}").start()

    def _request_iter(self):
        while True:
            item = self._requests.get()
            if item is _END:
                return
            yield item

    def attach(self, link: "_GrpcDraftLink", first: drafter_pb2.DraftRequest) -> None:
        with self._lock:
            if self.dead:
                raise DrafterUnavailable(f"the draft stream to {self.address} just ended")
            self._links[link.session_id] = link
            self._requests.put(first)

    def send(self, link: "_GrpcDraftLink", msg: drafter_pb2.DraftRequest, *, detach: bool = False) -> None:
        with self._lock:
            if detach and self._links.get(link.session_id) is link:
                del self._links[link.session_id]
            if not self.dead:
                self._requests.put(msg)

    def _receive(self) -> None:
        reason = "the drafter ended the draft stream"
        try:
            for msg in self._call:
                block = draft_block_from_proto(msg)
                with self._lock:
                    link = self._links.get(block.session_id)
                if link is not None:  # a session closed since: its late blocks are nobody's
                    link.deliver(block)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            reason = code.name if code is not None else str(exc)
        self._die(reason)

    def _die(self, reason: str) -> None:
        with self._lock:
            self.dead = True
            links, self._links = list(self._links.values()), {}
            self._requests.put(_END)
        self._on_dead(self)
        if links:
            log.warning("draft stream to %s ended (%s): %d sessions decode without it until they reconnect",
                        self.address, reason, len(links))
        for link in links:
            link.lost(reason)

    def close(self) -> None:
        with self._lock:
            self.dead = True
            self._requests.put(_END)
        self._call.cancel()


class _GrpcDraftLink:
    """One session on its drafter's shared stream."""

    def __init__(self, stream: _DraftStream, request: DraftSessionOpen, *,
                 on_block: Callable[[DraftBlock], None], on_lost: Callable[[str], None]):
        self.session_id = request.session_id
        self._stream = stream
        self._on_block, self._on_lost = on_block, on_lost
        self._closed = False
        self._lock = threading.Lock()
        stream.attach(self, drafter_pb2.DraftRequest(session_id=request.session_id, open=draft_open_to_proto(request)))

    def deliver(self, block: DraftBlock) -> None:
        if not self._closed:
            self._on_block(block)

    def lost(self, reason: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._on_lost(reason)

    def commit(self, committed_len: int, appended_ids: list[int], next_block_len: int) -> None:
        if self._closed:
            return
        self._stream.send(self, drafter_pb2.DraftRequest(
            session_id=self.session_id,
            commit=drafter_pb2.Commit(committed_len=committed_len, appended_ids=appended_ids,
                                      next_block_len=next_block_len),
        ))

    def close(self, reason: str) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stream.send(self, drafter_pb2.DraftRequest(
            session_id=self.session_id, close=drafter_pb2.CloseSession(reason=reason)), detach=True)


class GrpcDrafterConnector:
    """`DrafterConnector` over gRPC; one channel per drafter address, shared by every session.

    The pool holds at most `max_channels` channels; beyond that the least recently used one is
    closed (its streams end; their sessions reconnect, with fallback steps meanwhile). The verifier's
    allowlist already bounds the addresses; this bound holds whoever calls `open`.
    """

    def __init__(self, max_channels: int = 64, tls: TlsConfig | None = None) -> None:
        """`tls`: mutual TLS to the drafters: present tls.cert, accept only a peer whose certificate
        chains to tls.ca and names the drafter role (tandem.serving.tls.DRAFTER_NAME)."""
        if max_channels < 1:
            raise ValueError(f"max_channels must be >= 1, got {max_channels}")
        self.max_channels = max_channels
        self._tls = tls
        self._lock = threading.Lock()
        self._channels: OrderedDict[str, grpc.Channel] = OrderedDict()  # least recently used first
        self._streams: dict[str, _DraftStream] = {}  # the live stream per drafter address

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = (
                    grpc.insecure_channel(address) if self._tls is None else
                    grpc.secure_channel(address, channel_credentials(self._tls), options=channel_options(DRAFTER_NAME))
                )
                while len(self._channels) > self.max_channels:
                    old_address, old = self._channels.popitem(last=False)
                    log.warning("closing the channel to drafter %s: more than %d drafters in use",
                                old_address, self.max_channels)
                    self._streams.pop(old_address, None)
                    old.close()
            else:
                self._channels.move_to_end(address)
            return ch

    def _stream(self, address: str) -> _DraftStream:
        ch = self._channel(address)
        with self._lock:
            stream = self._streams.get(address)
            if stream is None or stream.dead:
                stream = self._streams[address] = _DraftStream(drafter_pb2_grpc.DrafterStub(ch), address, self._forget)
            return stream

    def _forget(self, stream: _DraftStream) -> None:
        with self._lock:
            if self._streams.get(stream.address) is stream:
                del self._streams[stream.address]

    def streams(self) -> int:
        """Draft streams open now (one per drafter in use)."""
        with self._lock:
            return len(self._streams)

    def open(self, address: str, request: DraftSessionOpen, *, on_block: Callable[[DraftBlock], None],
             on_lost: Callable[[str], None], headers: Sequence[tuple[str, str]] = ()) -> _GrpcDraftLink:
        """A link for one session on the drafter's shared stream; `headers`' trace context goes
        into its OpenSession (the stream's metadata belongs to no one request)."""
        trace = {k: v for k, v in headers if k in TRACE_KEYS}
        request = dataclasses.replace(request, trace_context=trace)
        for attempt in (1, 2):  # the stream may end between looking it up and attaching to it
            try:
                return _GrpcDraftLink(self._stream(address), request, on_block=on_block, on_lost=on_lost)
            except DrafterUnavailable:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
        for stream in streams:
            stream.close()
