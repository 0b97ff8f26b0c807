"""The gRPC implementation of the verifier's `DrafterConnector` (drafting.py): one channel per
drafter address, one `Drafter.Draft` stream per session link, a thread that reads its blocks.

Everything gRPC-shaped stays here; what crosses into the core is drafting.py's domain objects,
converted by tandem.serving.protoconv.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import grpc

from tandem.serving.tls import DRAFTER_NAME, TlsConfig, channel_credentials, channel_options
from tandem.serving.protoconv import draft_block_from_proto, draft_open_to_proto
from tandem.v1 import drafter_pb2, drafter_pb2_grpc

from tandem.serving.messages import DraftBlock, DraftSessionOpen

from .drafting import DrafterUnavailable

log = logging.getLogger("tandem.verifier.drafter_client")

_END = object()  # sentinel that ends a link's request iterator
_CLOSE_GRACE_S = 1.0  # after Close, how long the drafter has to end the stream before we cancel it


class _GrpcDraftLink:
    """One session on one `Draft` stream: requests go through a queue the call iterates, blocks
    come back on a daemon thread."""

    def __init__(self, stub: drafter_pb2_grpc.DrafterStub, request: DraftSessionOpen, *,
                 on_block: Callable[[DraftBlock], None], on_lost: Callable[[str], None],
                 headers: Sequence[tuple[str, str]]):
        self.session_id = request.session_id
        self._requests: queue.Queue = queue.Queue()
        self._on_block, self._on_lost = on_block, on_lost
        self._closed = False
        self._requests.put(drafter_pb2.DraftRequest(session_id=request.session_id,
                                                    open=draft_open_to_proto(request)))
        try:
            self._call = stub.Draft(self._request_iter(), metadata=tuple(headers))
        except grpc.RpcError as exc:  # creation itself rarely fails; the stream reports errors
            raise DrafterUnavailable(str(exc)) from None
        threading.Thread(target=self._receive, daemon=True, name="draft-recv").start()

    def _request_iter(self):
        while True:
            item = self._requests.get()
            if item is _END:
                return
            yield item

    def _receive(self) -> None:
        try:
            for msg in self._call:
                self._on_block(draft_block_from_proto(msg))
        except grpc.RpcError as exc:
            if not self._closed:
                code = exc.code() if hasattr(exc, "code") else None
                self._on_lost(code.name if code is not None else str(exc))

    def commit(self, committed_len: int, appended_ids: list[int], next_block_len: int) -> None:
        self._requests.put(drafter_pb2.DraftRequest(
            session_id=self.session_id,
            commit=drafter_pb2.Commit(committed_len=committed_len, appended_ids=appended_ids,
                                      next_block_len=next_block_len),
        ))

    def close(self, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        self._requests.put(drafter_pb2.DraftRequest(
            session_id=self.session_id, close=drafter_pb2.CloseSession(reason=reason)))
        self._requests.put(_END)
        # Let the Close reach the drafter, then make sure the stream is torn down.
        threading.Timer(_CLOSE_GRACE_S, self._call.cancel).start()


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
                    old.close()
            else:
                self._channels.move_to_end(address)
            return ch

    def open(self, address: str, request: DraftSessionOpen, *, on_block: Callable[[DraftBlock], None],
             on_lost: Callable[[str], None], headers: Sequence[tuple[str, str]] = ()) -> _GrpcDraftLink:
        stub = drafter_pb2_grpc.DrafterStub(self._channel(address))
        return _GrpcDraftLink(stub, request, on_block=on_block, on_lost=on_lost, headers=headers)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
