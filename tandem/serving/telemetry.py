"""Tracing: OpenTelemetry spans across gateway, verifier and drafter, exported by OTLP.

Configured by the standard `OTEL_*` environment variables, which the SDK reads itself:

    OTEL_EXPORTER_OTLP_ENDPOINT=http://jaeger:4317   where spans go (OTLP/gRPC); unset = tracing off
    OTEL_EXPORTER_OTLP_INSECURE=true                  plaintext gRPC to the collector
    OTEL_SERVICE_NAME=tandem-verifier                 overrides the service's own name
    OTEL_TRACES_SAMPLER=parentbased_traceidratio      and OTEL_TRACES_SAMPLER_ARG=0.1, ...
    OTEL_TRACES_EXPORTER=none                         tracing off even with an endpoint set

Tracing off (the default) leaves OpenTelemetry's no-op provider in place and installs no
instrumentation: a span costs a context switch of a few microseconds, nothing against a target
forward of milliseconds.

One request is one trace. Context crosses processes as W3C `traceparent`: from the client's HTTP
header (FastAPI instrumentation) or gRPC metadata (gRPC server instrumentation) into the gateway,
from the gateway to the verifier (`inject_metadata` on the grpc.aio client call: the aio client
instrumentation would hide `Call.read()`, which the gateway uses), and from the verifier to the
drafter in each session's OpenSession (`trace_context`: one draft stream per drafter carries the
sessions of many requests, so its own metadata and spans belong to none). The tree of one chat
completion:

    POST /v1/chat/completions                 gateway: HTTP server span, child of the client's traceparent
      route                                   verifier chosen, reason (session|prefix|load), residency hit|miss
      /tandem.v1.Verifier/Generate            gateway: client span (or /tandem.v1.Gateway/Generate over gRPC)
        /tandem.v1.Verifier/Generate          verifier: server span
          draft_session                       drafter: the session's span (open to close)
            draft_block ...                   proposer, drafted, draft_time_us, speculative
          prefill                             tokens reused vs computed
          verify_step ...                     block_len, drafted, accepted, recovered|bonus, batch_size;
                                              events drafter_fallback, draft_blocks_rejected

Attribute names use docs/design.md's terms under the `tandem.` prefix (tandem.drafted, tandem.accepted,
tandem.recovered, tandem.bonus).
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Mapping, Sequence

from opentelemetry import propagate, trace

log = logging.getLogger("tandem.serving.telemetry")

tracer = trace.get_tracer("tandem")  # a proxy: real once setup_tracing installs a provider

# Calls that say nothing about a request: liveness probes, reflection, the gateway's polling.
# GetInfo: polling. Draft: the drafter stream lives as long as the verifier and carries many
# requests' sessions; each session's span joins its own request's trace (OpenSession.trace_context).
_UNTRACED_METHODS = ("GetInfo", "Draft")

_provider = None  # the SDK TracerProvider once installed


def tracing_configured(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces: an OTLP endpoint is set and neither
    OTEL_SDK_DISABLED nor OTEL_TRACES_EXPORTER=none turns them off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service_name: str) -> bool:
    """Install an SDK tracer provider exporting by OTLP, and instrument gRPC servers and sync
    clients, when the environment asks for traces (see `tracing_configured`); True if it did.

    `service_name` is the default `service.name`; OTEL_SERVICE_NAME overrides it. The sampler is
    the SDK's choice from OTEL_TRACES_SAMPLER (default: parent-based, always on). Spans are
    batched (OTEL_BSP_*) and flushed at exit (`shutdown_tracing`, also run by atexit)."""
    global _provider
    if _provider is not None:
        return True
    if not tracing_configured():
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorServer,
        GrpcInstrumentorClient,
        GrpcInstrumentorServer,
        filters,
    )
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    atexit.register(shutdown_tracing)

    untraced = filters.negate(filters.any_of(
        filters.health_check(),
        filters.service_prefix("grpc.reflection"),
        *(filters.method_name(m) for m in _UNTRACED_METHODS),
    ))
    GrpcInstrumentorServer(filter_=untraced).instrument()
    GrpcAioInstrumentorServer(filter_=untraced).instrument()
    GrpcInstrumentorClient(filter_=untraced).instrument()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    log.info("tracing on: %s exports spans by OTLP to %s",
             provider.resource.attributes.get(SERVICE_NAME), endpoint)
    return True


def shutdown_tracing() -> None:
    """Export what is still batched and stop the exporter (idempotent)."""
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        provider.shutdown()


def instrument_http_app(app) -> None:
    """Server spans for a FastAPI app (and `traceparent` from its requests), when tracing is on.
    Per-message ASGI send/receive spans are left out: a stream would make one per SSE event."""
    if _provider is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(
        app, excluded_urls="/health,/healthz,/metrics", exclude_spans=["send", "receive"]
    )


def inject_metadata(metadata: Sequence[tuple[str, str]] = (), span=None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata plus the W3C context (`traceparent`, `tracestate`) of `span` (default: the
    current context); unchanged when there is no valid context to send."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(carrier, context=ctx)
    if not carrier:
        return tuple(metadata)
    return tuple((k, v) for k, v in metadata if k not in carrier) + tuple(carrier.items())


__all__ = [
    "inject_metadata",
    "instrument_http_app",
    "setup_tracing",
    "shutdown_tracing",
    "tracer",
    "tracing_configured",
]
