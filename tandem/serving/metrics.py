"""Prometheus sinks of each service's statistics (prometheus-client, one registry per service).

One statistics path per service. The verifier reports each step, prefill and eviction here as it
happens, and these metrics are its only counters (tests and logs read them too, through `value`).
The gateway and the drafter keep stats objects of their own (GatewayStats for /health,
DrafterStats), which these sinks read at scrape time, as they read values the domain owns (KV in
use, Redis errors) rather than count them a second time. Nothing is exported
until `serve` (the services' `--metrics-port`; the gateway also answers GET /metrics on its HTTP
port). Names follow Prometheus conventions: `_total` counters, base units in the name.

    verifier  tandem_drafted_tokens_total, tandem_accepted_tokens_total, tandem_recovered_tokens_total,
              tandem_bonus_tokens_total, tandem_generated_tokens_total, tandem_verify_steps_total{kind},
              tandem_drafted_by_position_total{position}, tandem_accepted_by_position_total{position},
              tandem_accepted_length_tokens (histogram), tandem_verify_batch_size (histogram),
              tandem_step_phase_seconds{phase} (histogram: the step loop's plan, forward, verify, commit),
              tandem_prefill_tokens_total{kind}, tandem_kv_used_tokens, tandem_kv_capacity_tokens,
              tandem_resident_sessions, tandem_kv_evictions_total, tandem_drafter_fallback_steps_total,
              tandem_rejected_draft_blocks_total, tandem_redis_errors_total
    gateway   tandem_time_to_first_token_seconds, tandem_inter_token_latency_seconds (histograms),
              tandem_residency_lookups_total{result}, tandem_routing_decisions_total{reason},
              tandem_verifier_connect_failures_total, tandem_redis_errors_total, tandem_requests_in_flight
    drafter   tandem_draft_blocks_total{kind}, tandem_speculative_blocks_total{outcome},
              tandem_draft_seconds_total, tandem_draft_sessions_active
    all       tandem_requests_total{service,status}

Worked example: a verify step that drafted 4 tokens of which the first 2 were accepted adds 4 to
drafted, 2 to accepted, 1 to recovered, 1 to drafted_by_position{1..4}, 1 to
accepted_by_position{1,2}, and observes 3 (= accepted + 1 committed tokens) in accepted_length.
So acceptance rate = accepted / drafted, and accepted_length's sum / count is the mean accepted
length (committed tokens per target step, docs/design.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tandem.serving.routing import RESIDENCY_HITS

log = logging.getLogger("tandem.serving.metrics")

disable_created_metrics()  # no `_created` series beside every counter: they only clutter dashboards

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 32, 48, 65)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REQUESTS_DOC = "Requests handled, by service and outcome (ok, cancelled, or the error's kind)."
_PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


def status_of(exc: BaseException) -> str:
    """The `status` label of a request that failed with `exc`: its class in snake case
    (InvalidRequest -> invalid_request)."""
    name = type(exc).__name__
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


class _Read:
    """A collector exporting one value the domain owns, read at scrape time."""

    def __init__(self, name: str, doc: str, read: Callable[[], float], kind: str):
        self._name, self._doc, self._read, self._kind = name, doc, read, kind

    def describe(self):
        return []  # values only exist at collect time

    def collect(self):
        family = CounterMetricFamily if self._kind == "counter" else GaugeMetricFamily
        yield family(self._name, self._doc, value=float(self._read()))


class ServiceMetrics:
    """What every service exports: its registry, requests by outcome, the HTTP endpoint."""

    def __init__(self, service: str, *, count_requests: bool = True):
        self.service = service
        self.registry = CollectorRegistry()
        if count_requests:
            self._requests = Counter("tandem_requests", _REQUESTS_DOC, ["service", "status"], registry=self.registry)
        self.server = None

    def request(self, status: str) -> None:
        self._requests.labels(self.service, status).inc()

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (a counter's name ends in `_total`); 0 if never set."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def read(self, name: str, doc: str, read: Callable[[], float], *, kind: str = "gauge") -> None:
        """Export a value owned elsewhere (`kind` "counter": monotonic, name without `_total`)."""
        self.registry.register(_Read(name, doc, read, kind))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve GET /metrics on host:port (0 = any free port) from a daemon thread; the bound port."""
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self.server.server_port
        log.info("%s metrics on http://%s:%d/metrics", self.service, host, bound)
        return bound

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class VerifierMetrics(ServiceMetrics):
    """The speculation figures: the verifier is the authority on what was drafted and accepted."""

    def __init__(self) -> None:
        super().__init__("verifier")
        r = self.registry
        self._drafted = Counter("tandem_drafted_tokens", "Draft tokens sent to verification.", registry=r)
        self._accepted = Counter("tandem_accepted_tokens", "Draft tokens the target agreed with.", registry=r)
        self._recovered = Counter(
            "tandem_recovered_tokens", "Tokens the target emitted at a first rejected draft.", registry=r)
        self._bonus = Counter(
            "tandem_bonus_tokens", "Tokens the target emitted after every draft of a step was accepted "
            "(plain steps included).", registry=r)
        self._generated = Counter("tandem_generated_tokens", "Output tokens committed and streamed.", registry=r)
        self._steps = Counter(
            "tandem_verify_steps", "Target forwards of decode loops: speculative (verified drafts) or plain.",
            ["kind"], registry=r)
        self._drafted_at = Counter(
            "tandem_drafted_by_position", "Verify steps that drafted a token at this 1-based draft position.",
            ["position"], registry=r)
        self._accepted_at = Counter(
            "tandem_accepted_by_position", "Verify steps whose draft at this 1-based position was accepted.",
            ["position"], registry=r)
        self._length = Histogram(
            "tandem_accepted_length_tokens", "Tokens committed per target step (accepted + 1); its mean is the "
            "mean accepted length.", buckets=_LENGTH_BUCKETS, registry=r)
        self._batch = Histogram(
            "tandem_verify_batch_size", "Sequences verified together in one target forward.",
            buckets=_BATCH_BUCKETS, registry=r)
        self._prefill = Counter(
            "tandem_prefill_tokens", "Context tokens at prefill: reused (KV resident) or computed.",
            ["kind"], registry=r)
        self._shared = Counter(
            "tandem_prefix_shared_tokens", "Context tokens whose KV was copied from another resident session "
            "(a shared system prompt or tool schema; counted in reused too).", registry=r)
        self._evictions = Counter("tandem_kv_evictions", "Idle sessions evicted to make room in the KV cache.",
                                  registry=r)
        self._recomputed = Counter(
            "tandem_prefill_recomputed_tokens", "Context tokens computed again because their session's KV was "
            "evicted from this verifier (counted in computed too).", registry=r)
        self._fallback = Counter(
            "tandem_drafter_fallback_steps", "Steps without a usable drafter block in time (drafted by the "
            "verifier's own prompt lookup, or decoded plainly).",
            registry=r)
        self._rejected = Counter(
            "tandem_rejected_draft_blocks", "Draft blocks dropped unverified: stale base, garbage ids, malformed "
            "proposals.", registry=r)
        self._by_proposer = Counter(
            "tandem_proposer_tokens", "Draft tokens by the proposer that drafted them (a hybrid session uses "
            "two) and outcome (drafted, accepted).", ["proposer", "outcome"], registry=r)
        self._phase = Histogram(
            "tandem_step_phase_seconds", "Time of each part of a step of the verifier's step loop: plan (drafts, "
            "block lengths), forward, verify (the kernels), commit (KV, streams, drafters).", ["phase"],
            buckets=_PHASE_BUCKETS, registry=r)
        self._phases = {name: self._phase.labels(name) for name in ("plan", "forward", "verify", "commit")}
        self._kv_capacity = Gauge("tandem_kv_capacity_tokens", "KV cache budget over all sessions.", registry=r)
        self._positions: list = []  # (drafted child, accepted child) per position, created on use

    def watch_kv(self, capacity_tokens: int, used_tokens: Callable[[], int], resident: Callable[[], int]) -> None:
        self._kv_capacity.set(capacity_tokens)
        self.read("tandem_kv_used_tokens", "KV cache tokens held by resident sessions.", used_tokens)
        self.read("tandem_resident_sessions", "Sessions whose KV cache is resident.", resident)

    def step(self, drafted: int, accepted: int, emitted: int, batch_size: int = 1, proposer: str | None = None) -> None:
        if proposer and drafted:
            self._by_proposer.labels(proposer, "drafted").inc(drafted)
            self._by_proposer.labels(proposer, "accepted").inc(accepted)
        self._drafted.inc(drafted)
        self._accepted.inc(accepted)
        (self._bonus if accepted == drafted else self._recovered).inc()
        self._generated.inc(emitted)
        self._steps.labels("speculative" if drafted else "plain").inc()
        while len(self._positions) < drafted:
            pos = str(len(self._positions) + 1)
            self._positions.append((self._drafted_at.labels(pos), self._accepted_at.labels(pos)))
        for i in range(drafted):
            self._positions[i][0].inc()
            if i < accepted:
                self._positions[i][1].inc()
        self._length.observe(accepted + 1)
        self._batch.observe(batch_size)

    def loop_step(self, phases) -> None:
        """One step of the step loop (tandem.engine.scheduler.runner.StepPhases)."""
        for name, child in self._phases.items():
            child.observe(getattr(phases, name))

    def prefill(self, reused: int, computed: int) -> None:
        self._prefill.labels("reused").inc(reused)
        self._prefill.labels("computed").inc(computed)

    def shared(self, tokens: int) -> None:
        self._shared.inc(tokens)

    def recomputed(self, tokens: int) -> None:
        self._recomputed.inc(tokens)

    def faults(self, fallback_steps: int, rejected_blocks: int) -> None:
        self._fallback.inc(fallback_steps)
        self._rejected.inc(rejected_blocks)

    def eviction(self) -> None:
        self._evictions.inc()


class GatewayMetrics(ServiceMetrics):
    """What clients see: latency to the first token and between tokens; where requests went and
    verifiers that failed at connect are read from the gateway's stats (`routed`: reason -> count)."""

    def __init__(self, routed: Callable[[], Mapping[str, int]], connect_failures: Callable[[], int]) -> None:
        super().__init__("gateway")
        self.registry.register(_RoutingCollector(routed, connect_failures))
        r = self.registry
        self._ttft = Histogram(
            "tandem_time_to_first_token_seconds", "From a request's arrival to its first generated token.",
            buckets=_TTFT_BUCKETS, registry=r)
        self._itl = Histogram(
            "tandem_inter_token_latency_seconds", "Time per output token between streamed chunks (a chunk of n "
            "tokens after a gap g counts n times at g/n).", buckets=_ITL_BUCKETS, registry=r)
    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def tokens(self, n: int, gap_seconds: float) -> None:
        for _ in range(n):
            self._itl.observe(gap_seconds / n)


def _labelled(name: str, doc: str, label: str, values: Mapping[str, float]) -> CounterMetricFamily:
    """A counter family with one label, from a mapping label value -> count."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in values.items():
        family.add_metric([key], n)
    return family


class _RoutingCollector:
    """The gateway's routing counters, read from its stats at scrape time."""

    def __init__(self, routed: Callable[[], Mapping[str, int]], connect_failures: Callable[[], int]):
        self._routed, self._connect_failures = routed, connect_failures

    def describe(self):
        return []

    def collect(self):
        routed = dict(self._routed())
        yield _labelled("tandem_routing_decisions", "Routing decisions by reason: session, prefix, load, "
                        "redis-unavailable.", "reason", routed)
        hits = sum(n for reason, n in routed.items() if reason in RESIDENCY_HITS)
        yield _labelled("tandem_residency_lookups", "Routing decisions by KV residency: hit (session or prefix "
                        "resident on the chosen verifier) or miss (routed by load).", "result",
                        {"hit": hits, "miss": sum(routed.values()) - hits})
        yield CounterMetricFamily("tandem_verifier_connect_failures", "Verifiers found unreachable at connect "
                                  "(the next one tried).", value=self._connect_failures())


class DrafterMetrics(ServiceMetrics):
    """The drafter's counters (DrafterCore.stats()), read at scrape time."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        super().__init__("drafter", count_requests=False)
        self.registry.register(_DrafterCollector(stats, self.service))


class _DrafterCollector:
    def __init__(self, stats: Callable[[], dict], service: str):
        self._stats, self._service = stats, service

    def describe(self):
        return []

    def collect(self):
        s = self._stats()
        yield _labelled(
            "tandem_draft_blocks", "Draft blocks sent: regular (at the committed length) or speculative "
            "(drafted ahead while the previous block was verified).", "kind",
            {"regular": s["regular_blocks"], "speculative": s["speculative_blocks"]})
        yield _labelled(
            "tandem_speculative_blocks", "Speculative blocks by outcome: used (consistent with the next "
            "commit) or wasted.", "outcome", {"used": s["speculative_used"], "wasted": s["speculative_wasted"]})
        yield CounterMetricFamily("tandem_draft_seconds", "Seconds spent drafting (every block).",
                                  value=s["draft_seconds"])
        yield GaugeMetricFamily("tandem_draft_sessions_active", "Open draft sessions.", value=s["active_sessions"])
        yield GaugeMetricFamily("tandem_draft_sessions_parked", "Closed sessions whose draft state waits for their "
                                "next turn (DrafterSettings.parked_sessions).", value=s["parked_sessions"])
        yield CounterMetricFamily("tandem_draft_sessions_resumed", "Sessions opened on a parked session's draft "
                                  "state (a next turn that read only its new tokens).", value=s["sessions_resumed"])
        suffix = s.get("suffix")
        if suffix is not None:
            yield GaugeMetricFamily("tandem_suffix_store_tokens", "Tokens of earlier answers held for suffix "
                                    "decoding, all stores (target model x tenant) together.", value=suffix["tokens"])
            yield GaugeMetricFamily("tandem_suffix_store_responses", "Earlier answers held for suffix decoding.",
                                    value=suffix["responses"])
            yield GaugeMetricFamily("tandem_suffix_stores", "Suffix stores (one per target model and tenant).",
                                    value=suffix["stores"])
        # A drafter's requests are its sessions: opened (ok) or dropped with a status.
        requests = CounterMetricFamily("tandem_requests", _REQUESTS_DOC, labels=["service", "status"])
        requests.add_metric([self._service, "ok"], s["sessions_opened"])
        for status, n in sorted(s["session_errors"].items()):
            requests.add_metric([self._service, status.lower()], n)
        yield requests


__all__ = ["CONTENT_TYPE", "DrafterMetrics", "GatewayMetrics", "ServiceMetrics", "VerifierMetrics", "status_of"]
