"""Observability of a real local stack (gateway, verifier, drafter as `tandem` subprocesses on a tiny
model): the spans of one request form one trace across the three services, exported by OTLP to a
receiver in this process; each service's Prometheus counters move by what the responses report;
log lines carry trace and session ids."""

from __future__ import annotations

import io
import json
import logging
import re
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families

from tandem.tools.stack import Stack, StackConfig, free_port
from conftest import make_tiny_llama, make_tiny_tokenizer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"  # the client's span: the gateway's request span hangs below it
SECOND_TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SESSION = "obs-session"
# Repetitive text gives prompt lookup matches, so the request really drafts and verifies.
PROMPT = "the cat and the dog and the cat and the dog and the cat and the dog and the"

pytestmark = pytest.mark.timeout(180)


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps (service.name, span) of everything exported to it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, trace_pb2.Span]] = []

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((attrs.get("service.name", ""), span) for span in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def _grpc_turn(address: str) -> dict:
    """The session's next turn through tandem.v1.Gateway/Generate, its usage shaped as over HTTP."""
    from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.GenerateRequest(
        session_id=SESSION,
        messages=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=PROMPT)]),
        sampling=common_pb2.SamplingParams(max_new_tokens=24),
        speculation=common_pb2.SpeculationParams(strategy=common_pb2.DRAFT_STRATEGY_SUFFIX, max_draft_tokens=6),
    )
    with grpc.insecure_channel(address) as channel:
        chunks = list(gateway_pb2_grpc.GatewayStub(channel).Generate(
            request, timeout=60, metadata=(("traceparent", f"00-{SECOND_TRACE_ID}-{PARENT_ID}-01"),)))
    last = chunks[-1]
    fields = ("drafted", "accepted", "recovered", "bonus", "steps", "plain_steps", "fallback_steps", "rejected_blocks")
    return {"usage": {
        "completion_tokens": last.usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": last.usage.cached_prompt_tokens},
        "speculation": {f: getattr(last.stats, f) for f in fields},
    }}


@dataclass
class Observed:
    responses: list[dict]
    spans: list[tuple[str, trace_pb2.Span]]
    before: dict[str, dict]
    after: dict[str, dict]
    exit_codes: dict[str, int]

    def delta(self, process: str, name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self.after[process].get(key, 0.0) - self.before[process].get(key, 0.0)

    def total(self, field: str) -> int:
        return sum(r["usage"]["speculation"][field] for r in self.responses)


@pytest.fixture(scope="module")
def observed(tmp_path_factory, redis_url) -> Observed:
    import redis

    redis.Redis.from_url(redis_url).flushdb()  # no verifier registered by an earlier test
    model_dir = tmp_path_factory.mktemp("obs") / "tiny"
    make_tiny_tokenizer().save_pretrained(model_dir)
    make_tiny_llama(seed=0, num_layers=2).save_pretrained(model_dir)

    receiver = _Receiver()
    otlp = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, otlp)
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
    }
    stack = Stack(StackConfig(
        model=str(model_dir), redis_url=redis_url, http_port=free_port(), grpc_port=free_port(),
        verifier_threads=1, startup_timeout_s=60, log_level="warning", extra_env=env,
    ))
    try:
        stack.start()
        before = {name: _scrape(url) for name, url in stack.metrics_urls.items()}
        # Two turns of one session: over HTTP, then over the gateway's gRPC API.
        r = httpx.post(
            f"{stack.http_url}/v1/chat/completions", timeout=60,
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Session-Id": SESSION},
            json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
                  "speculation": {"strategy": "suffix", "max_draft_tokens": 6}},
        )
        assert r.status_code == 200, r.text
        responses = [r.json(), _grpc_turn(stack.grpc_address)]
        after = {name: _scrape(url) for name, url in stack.metrics_urls.items()}
    finally:
        procs = list(stack.procs)
        stack.stop()  # SIGTERM: each service flushes its batched spans as it exits
    codes = {name: proc.returncode for name, proc in procs}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with receiver.lock:
            if {"tandem-gateway", "tandem-verifier", "tandem-drafter"} <= {s for s, _ in receiver.spans}:
                break
        time.sleep(0.1)
    otlp.stop(None)
    return Observed(responses, list(receiver.spans), before, after, codes)


def _attrs(span: trace_pb2.Span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


@pytest.mark.slow  # the module fixture starts the three services as processes
def test_one_trace_across_the_three_services(observed: Observed) -> None:
    assert set(observed.exit_codes.values()) == {0}, f"every service stops gracefully: {observed.exit_codes}"
    spans = [(svc, s) for svc, s in observed.spans if s.trace_id.hex() == TRACE_ID]
    assert {s.trace_id.hex() for _, s in observed.spans} == {TRACE_ID, SECOND_TRACE_ID}, (
        "every span belongs to one of the two requests' traces (health checks and polling are not traced)")
    assert {svc for svc, _ in spans} == {"tandem-gateway", "tandem-verifier", "tandem-drafter"}

    by_id = {s.span_id: (svc, s) for svc, s in spans}
    roots = [s for _, s in spans if s.parent_span_id.hex() == PARENT_ID]
    assert len(roots) == 1 and roots[0].kind == trace_pb2.Span.SPAN_KIND_SERVER, "the HTTP span continues the traceparent"
    http = roots[0]
    assert http.name.startswith("POST /v1/chat/completions")
    for _, s in spans:  # every other span hangs below a span of this trace: one tree
        assert s is http or s.parent_span_id in by_id, s.name

    def children(parent: trace_pb2.Span, name: str, service: str) -> list[trace_pb2.Span]:
        return [s for svc, s in spans if s.parent_span_id == parent.span_id and s.name == name and svc == service]

    response = observed.responses[0]
    (route,) = children(http, "route", "tandem-gateway")
    a = _attrs(route)
    assert a["tandem.routing.reason"] == response["tandem"]["routing"] == "load"
    assert a["tandem.routing.verifier_id"] == response["tandem"]["verifier_id"]
    assert a["tandem.routing.residency"] == "miss" and a["tandem.session_id"] == SESSION
    (client,) = children(http, "/tandem.v1.Verifier/Generate", "tandem-gateway")
    assert client.kind == trace_pb2.Span.SPAN_KIND_CLIENT
    (server,) = children(client, "/tandem.v1.Verifier/Generate", "tandem-verifier")
    assert server.kind == trace_pb2.Span.SPAN_KIND_SERVER

    (prefill,) = children(server, "prefill", "tandem-verifier")
    a = _attrs(prefill)
    assert a["tandem.prefill.reused_tokens"] == response["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert a["tandem.prefill.computed_tokens"] > 0
    steps = children(server, "verify_step", "tandem-verifier")
    spec = response["usage"]["speculation"]
    assert len(steps) == spec["steps"]
    step_attrs = [_attrs(s) for s in steps]
    for key in ("drafted", "accepted", "recovered", "bonus"):
        assert sum(a[f"tandem.{key}"] for a in step_attrs) == spec[key], key
    assert all(a["tandem.batch_size"] == 1 and a["tandem.block_len"] == a["tandem.drafted"] for a in step_attrs)
    assert spec["drafted"] > 0, "the request must actually speculate"

    # One draft stream carries every session of the verifier: the session's own span on the
    # drafter joins this request's trace (OpenSession.trace_context), and its blocks sit under it.
    (draft_session,) = children(server, "draft_session", "tandem-drafter")
    assert _attrs(draft_session)["tandem.session_id"] == SESSION
    blocks = children(draft_session, "draft_block", "tandem-drafter")
    assert blocks, "each draft block is a span under the drafter's session span"
    for b in map(_attrs, blocks):
        assert b["tandem.proposer"] == "suffix" and b["tandem.session_id"] == SESSION
        assert b["tandem.draft_time_us"] >= 0 and isinstance(b["tandem.speculative"], bool)
    assert any(b["tandem.drafted"] > 0 for b in map(_attrs, blocks))

    # The second turn came over gRPC: its trace continues the traceparent of the call's metadata.
    second = [(svc, s) for svc, s in observed.spans if s.trace_id.hex() == SECOND_TRACE_ID]
    (root,) = [s for _, s in second if s.parent_span_id.hex() == PARENT_ID]
    assert root.name == "/tandem.v1.Gateway/Generate" and root.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert {svc for svc, _ in second} == {"tandem-gateway", "tandem-verifier", "tandem-drafter"}
    (route,) = [s for _, s in second if s.name == "route" and s.parent_span_id == root.span_id]
    assert _attrs(route)["tandem.routing.residency"] == "hit", "the second turn finds its session"
    (prefill,) = [s for _, s in second if s.name == "prefill"]
    assert _attrs(prefill)["tandem.prefill.reused_tokens"] == (
        observed.responses[1]["usage"]["prompt_tokens_details"]["cached_tokens"]) > 0


@pytest.mark.slow  # the module fixture starts the three services as processes
def test_metrics_move_by_what_the_responses_report(observed: Observed) -> None:
    o = observed
    verifier = "verifier-0"
    assert o.delta(verifier, "tandem_drafted_tokens_total") == o.total("drafted") > 0
    assert o.delta(verifier, "tandem_accepted_tokens_total") == o.total("accepted")
    assert o.delta(verifier, "tandem_recovered_tokens_total") == o.total("recovered")
    assert o.delta(verifier, "tandem_bonus_tokens_total") == o.total("bonus")
    steps = o.total("steps")
    assert o.delta(verifier, "tandem_accepted_length_tokens_count") == steps
    assert o.delta(verifier, "tandem_accepted_length_tokens_sum") == o.total("accepted") + steps
    assert o.delta(verifier, "tandem_verify_batch_size_count") == steps
    assert (o.delta(verifier, "tandem_verify_steps_total", kind="plain")
            == sum(r["usage"]["speculation"]["plain_steps"] for r in o.responses))
    assert sum(o.delta(verifier, "tandem_accepted_by_position_total", position=str(i)) for i in range(1, 7)) \
        == o.total("accepted")
    assert o.delta(verifier, "tandem_drafted_by_position_total", position="1") \
        == steps - o.delta(verifier, "tandem_verify_steps_total", kind="plain")
    assert o.delta(verifier, "tandem_generated_tokens_total") == sum(r["usage"]["completion_tokens"] for r in o.responses)
    assert o.delta(verifier, "tandem_drafter_fallback_steps_total") == o.total("fallback_steps")
    # by proposer (here suffix decoding only: the drafter's; prompt lookup would run on the
    # verifier and leave the drafter out of the trace): the same totals
    assert o.delta(verifier, "tandem_proposer_tokens_total", proposer="suffix", outcome="drafted") == o.total("drafted")
    assert o.delta(verifier, "tandem_proposer_tokens_total", proposer="suffix", outcome="accepted") == o.total("accepted")
    assert o.delta(verifier, "tandem_rejected_draft_blocks_total") == o.total("rejected_blocks")
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in o.responses]
    assert cached[0] == 0 and cached[1] > 0
    assert o.delta(verifier, "tandem_prefill_tokens_total", kind="reused") == sum(cached)
    assert o.delta(verifier, "tandem_requests_total", service="verifier", status="ok") == 2
    assert o.after[verifier][("tandem_kv_used_tokens", ())] > 0
    assert o.after[verifier][("tandem_kv_capacity_tokens", ())] == 65536
    assert o.after[verifier][("tandem_resident_sessions", ())] == 1
    assert o.delta(verifier, "tandem_redis_errors_total") == 0

    assert o.delta("gateway", "tandem_requests_total", service="gateway", status="ok") == 2
    assert o.delta("gateway", "tandem_residency_lookups_total", result="miss") == 1
    assert o.delta("gateway", "tandem_residency_lookups_total", result="hit") == 1
    assert o.delta("gateway", "tandem_routing_decisions_total", reason="session") == 1
    assert o.delta("gateway", "tandem_time_to_first_token_seconds_count") == 2
    assert 0 < o.delta("gateway", "tandem_inter_token_latency_seconds_count") < sum(
        r["usage"]["completion_tokens"] for r in o.responses)
    assert o.delta("gateway", "tandem_redis_errors_total") == 0

    assert o.delta("drafter", "tandem_requests_total", service="drafter", status="ok") == 2
    assert o.delta("drafter", "tandem_draft_blocks_total", kind="regular") > 0


@pytest.mark.slow  # the module fixture starts the three services as processes
def test_the_dashboard_queries_only_exported_metrics(observed: Observed) -> None:
    exported = {name for scrape in observed.after.values() for name, _ in scrape}
    dashboard = json.loads((Path(__file__).parents[2] / "deploy/grafana/tandem-dashboard.json").read_text())
    queried = {m for p in dashboard["panels"] for t in p.get("targets", []) for m in re.findall(r"tandem_\w+", t["expr"])}
    assert queried and queried <= exported, sorted(queried - exported)


def test_log_lines_carry_trace_and_session_ids() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from tandem.serving.logs import JsonFormatter, RequestContextFilter, TextFormatter, session_context

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("tandem.test-logs")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    tracer = TracerProvider().get_tracer("test")
    try:
        log.info("outside a request")
        with tracer.start_as_current_span("request") as span, session_context("s-42"):
            log.info("inside")
            handler.setFormatter(TextFormatter())
            log.info("inside, as text")
    finally:
        log.removeHandler(handler)
    outside, inside, text = out.getvalue().splitlines()
    assert set(json.loads(outside)) == {"ts", "level", "logger", "message"}
    record = json.loads(inside)
    ctx = span.get_span_context()
    assert record["trace_id"] == f"{ctx.trace_id:032x}" and record["span_id"] == f"{ctx.span_id:016x}"
    assert record["session_id"] == "s-42" and record["message"] == "inside"
    assert text.endswith(f"inside, as text [session=s-42 trace={ctx.trace_id:032x}]")


def test_tracing_is_off_unless_the_environment_asks() -> None:
    from opentelemetry import context, propagate, trace

    from tandem.serving.telemetry import inject_metadata, tracing_configured

    assert not tracing_configured({})
    assert tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"})
    assert tracing_configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://jaeger:4317"})
    assert not tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_TRACES_EXPORTER": "none"})
    assert not tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"})
    # The current context goes into gRPC metadata; without a valid span nothing is added.
    token = context.attach(propagate.extract({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}))
    try:
        assert f"{trace.get_current_span().get_span_context().trace_id:032x}" == TRACE_ID
        md = dict(inject_metadata((("x-other", "1"),)))
        assert md["traceparent"].split("-")[1] == TRACE_ID and md["x-other"] == "1"
    finally:
        context.detach(token)
    assert inject_metadata((("x-other", "1"),)) == (("x-other", "1"),)
