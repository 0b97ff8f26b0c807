"""The gateway's gRPC clients of verifiers and drafters: one channel per address, the conversion of
messages to and from domain objects (tandem.serving.protoconv), and the translation of gRPC
failures into the gateway's domain errors, so that core.py never sees grpc or protobuf.

A Verifier.Generate failure means different things depending on when it happens:
- before the first message, UNAVAILABLE (or a server-side CANCELLED) means the verifier is not
  there: the core tries the next candidate, which is safe because nothing was streamed and the
  request carries the whole context;
- RESOURCE_EXHAUSTED before the first message: that verifier's KV cache is full, try another;
- INVALID_ARGUMENT: the request itself is bad, retrying elsewhere cannot help;
- anything after the first message: the stream was cut mid-way (`StreamCut`): the core resumes
  it on another verifier from the tokens already streamed, or, when it cannot, the client learns
  that the rest is missing (never a silent truncation).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from tandem.serving.tls import DRAFTER_NAME, VERIFIER_NAME, TlsConfig, channel_credentials, channel_options
from tandem.services.gateway.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ShuttingDown,
    StreamCut,
    UpstreamFailed,
    VerifierBusy,
    VerifierUnreachable,
)
from tandem.serving.messages import CommittedTokens, DrafterInfo, VerifierRequest
from tandem.serving.telemetry import inject_metadata, tracer
from tandem.serving.protoconv import (
    committed_from_proto,
    drafter_info_from_proto,
    verifier_record_from_proto,
    verifier_request_to_proto,
)
from tandem.serving.residency import VerifierRecord
from tandem.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

log = logging.getLogger("tandem.gateway.client")

# A verifier that restarts is found again within a fraction of a second, not after gRPC's default
# reconnect backoff (1 s growing to 120 s).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),  # long contexts travel whole
]


class VerifierStream:
    """The CommittedTokens stream of one Verifier.Generate call (async iterator of domain
    `CommittedTokens`), with errors
    translated as described in the module docstring. `cancel()` ends the upstream call."""

    def __init__(self, call, address: str, span: trace.Span = trace.INVALID_SPAN):
        self._call = call
        self.address = address
        self.received = 0  # messages read so far
        self._span = span  # the call's client span, ended with the call
        self._cut: str | None = None  # why the gateway itself ended the call (cut())

    def _end_span(self, error: grpc.aio.AioRpcError | None = None) -> None:
        span, self._span = self._span, trace.INVALID_SPAN
        if error is not None:
            span.set_attribute("rpc.grpc.status_code", error.code().value[0])
            span.set_status(Status(StatusCode.ERROR, f"{error.code().name}: {error.details()}"))
        span.set_attribute("tandem.messages", self.received)
        span.end()

    def __aiter__(self) -> "VerifierStream":
        return self

    async def __anext__(self) -> CommittedTokens:
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            self._end_span(exc)
            if self._cut is not None:
                raise ShuttingDown(self._cut) from None
            raise self._translate(exc) from None
        except asyncio.CancelledError:
            if self._cut is None:
                raise
            raise ShuttingDown(self._cut) from None
        if msg is grpc.aio.EOF:
            self._end_span()
            raise StopAsyncIteration
        self.received += 1
        return committed_from_proto(msg)

    def cancel(self) -> None:
        self._call.cancel()
        self._end_span()

    def cut(self, reason: str) -> None:
        """End the call from the gateway's side (its own shutdown): the reader gets ShuttingDown(reason)."""
        self._cut = reason
        self.cancel()

    def _translate(self, exc: grpc.aio.AioRpcError) -> Exception:
        code, details = exc.code(), exc.details() or ""
        where = f"verifier at {self.address}"  # for the gateway's own log and retry logic only
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED) \
                or self.received:
            log.warning("%s failed after %d messages: %s: %s", where, self.received, code.name, details)
        # What reaches the client names no internal address and no upstream detail beyond the
        # status, except the verifier's own account of a request it refused as invalid.
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return DeadlineExceeded("the request's deadline passed while the verifier was generating")
        if self.received:
            return StreamCut(
                f"the verifier's stream broke after {self.received} messages ({code.name}); "
                "the completion is incomplete"
            )
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return VerifierUnreachable(f"{where}: {code.name}: {details}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return VerifierBusy(f"{where}: {details}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidRequest(f"the verifier rejected the request: {details}")
        return UpstreamFailed(f"the verifier failed before streaming ({code.name})")


class RpcClients:
    """Channels and stubs to verifiers and drafters, one channel per (address, role) (grpc.aio:
    create and use in one event loop). With `tls`, every channel is mutual TLS and the peer must
    present its role's certificate (tandem.serving.tls): a process registered in Redis with an
    address of its choosing cannot receive prompts without a verifier certificate from our CA."""

    def __init__(self, tls: TlsConfig | None = None) -> None:
        self._tls = tls
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    def _channel(self, address: str, role: str = VERIFIER_NAME) -> grpc.aio.Channel:
        channel = self._channels.get((address, role))
        if channel is None:
            if self._tls is None:
                channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(address, channel_credentials(self._tls),
                                                  options=_CHANNEL_OPTIONS + channel_options(role))
            self._channels[(address, role)] = channel
        return channel

    async def verifier_info(self, address: str, timeout_s: float) -> VerifierRecord | None:
        """GetInfo, or None when the verifier does not answer in time."""
        stub = verifier_pb2_grpc.VerifierStub(self._channel(address))
        try:
            return verifier_record_from_proto(await stub.GetInfo(verifier_pb2.InfoRequest(), timeout=timeout_s), address)
        except grpc.aio.AioRpcError as exc:
            log.debug("verifier %s GetInfo failed: %s", address, exc.code().name)
            return None

    async def drafter_info(self, address: str, timeout_s: float) -> DrafterInfo | None:
        stub = drafter_pb2_grpc.DrafterStub(self._channel(address, DRAFTER_NAME))
        try:
            return drafter_info_from_proto(await stub.GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=timeout_s))
        except grpc.aio.AioRpcError as exc:
            log.debug("drafter %s GetInfo failed: %s", address, exc.code().name)
            return None

    def generate(
        self, address: str, request: VerifierRequest, timeout_s: float | None
    ) -> VerifierStream:
        stub = verifier_pb2_grpc.VerifierStub(self._channel(address))
        # A client span by hand, its context in the metadata: the grpc.aio client instrumentation
        # would turn the call into an iterator without `read()`.
        span = tracer.start_span("/tandem.v1.Verifier/Generate", kind=SpanKind.CLIENT, attributes={
            "rpc.system": "grpc", "rpc.service": "tandem.v1.Verifier", "rpc.method": "Generate",
            "server.address": address,
        })
        call = stub.Generate(verifier_request_to_proto(request), timeout=timeout_s,
                             metadata=inject_metadata(span=span))
        return VerifierStream(call, address, span)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
