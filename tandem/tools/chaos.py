"""`tandem chaos`: a soak under a seeded fault schedule, with nothing lost.

It starts its own supervised stack (tandem/tools/stack.py: Valkey, a drafter, two verifiers and the
gateway as processes; on loopback, or each in a network namespace of its own with --netns), with a
delaying proxy on the drafter's and each verifier's link (tandem/tools/netem.py). N sessions hold
multi-turn conversations through the gateway's gRPC API for the duration, each turn sending the
whole history as token ids, while faults arrive on a schedule drawn from the seed:

    kill-<svc>      SIGKILL drafter, a verifier, the gateway or Valkey (the supervisor restarts it)
    term-verifier   SIGTERM a verifier: it drains and cuts its streams (the gateway resumes them)
    pause-verifier  SIGSTOP a verifier for a few seconds, then SIGCONT (a hung host)
    delay-<link>    a delay spike on the drafter's or a verifier's link for a few seconds
    drop-<link>     every open connection of that link reset

Every greedy response is checked, after the run, against plain decoding of the same token history
in this process (the target alone, no speculation). Every request ends as one of: completed,
completed after a failover (the gateway resumed it on another verifier), failed with an explicit
error (a gRPC status), a silent truncation (the stream ended without a finish reason and without
an error: must never happen) or a mismatch (completed, but not the target's tokens: must never
happen). Lost or duplicated tokens are caught by the first_index of every chunk. Latency is split
into calm and "under fault" (from a fault to 10 s after it, or until the service is back).

After the run, leak checks: no generation still active on any verifier, no draft session left on
the drafter, no request in flight at the gateway, every Redis residency key with a TTL and none
naming a verifier that is not live, and each service's RSS against its value after warm-up.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.engine.native.build import cpu_model

log = logging.getLogger("tandem.tools.chaos")

FAULTS = {  # name -> weight in the schedule
    "kill-verifier": 3, "term-verifier": 2, "pause-verifier": 2, "kill-drafter": 2, "kill-valkey": 1,
    "kill-gateway": 1, "delay-drafter-link": 2, "delay-verifier-link": 1, "drop-drafter-link": 1,
    "drop-verifier-link": 1,
}
UNDER_FAULT_S = 10.0  # a fault's window: latency samples this long after it count as "under fault"


@dataclass
class ChaosConfig:
    model: str = "default"
    duration_s: float = 120.0
    sessions: int = 4
    turns: int = 3  # turns per conversation; then a new conversation begins
    max_tokens: int = 48
    fault_every_s: float = 30.0
    seed: int = 0
    netns: bool = False
    verifiers: int = 2
    dataset: str = "mt_bench"
    prompts: tuple[str, ...] = ()  # user turns to use instead of the dataset's (e.g. short ones for a tiny model)
    faults: tuple[str, ...] = tuple(FAULTS)
    verifier_threads: int | None = None
    startup_timeout_s: float = 300.0
    # The GEMM mode of every process and of the reference: the default, "invariant" (a float32
    # target on our row-invariant kernels; the default GGUF target on quant.c either way), so
    # batched rows, prompt pieces and verified blocks equal one-token steps bit for bit and a
    # mismatch can only be a fault's doing. "auto" (the measured library plan) gives that up.
    gemm: str = "invariant"


@dataclass
class Outcome:
    session: str
    turn: int
    started: float  # seconds since the run began
    context: list[int]
    tokens: list[int] = field(default_factory=list)
    finish: str = ""  # stop | length | "" (none)
    error: str = ""  # gRPC status name of an explicit failure
    resumed: int = 0
    ttft_s: float | None = None
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (time since start, seconds per token)
    index_faults: int = 0  # chunks whose first_index did not continue the stream (lost / duplicated)
    mismatch: bool = False  # completed, but not the tokens of plain decoding (set after the run)
    diverged_at: int | None = None  # a mismatch's first differing output index
    expected_len: int | None = None


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


class Chaos:
    def __init__(self, config: ChaosConfig, on_event=None):
        self.config = config
        self.rng = random.Random(config.seed)
        self.on_event = on_event or (lambda text: None)
        self.outcomes: list[Outcome] = []
        self.faults: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = 0.0
        self.ended_early = False
        self.ran_s = 0.0

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> dict:
        from tandem.engine.model.tokenizer import apply_chat_template, load_tokenizer
        from tandem.tools.datasets import dev_set, load_prompts
        from tandem.tools.stack import Stack, StackConfig, Topology, free_port

        from tandem.engine.model.gemm import GemmSettings

        c = self.config
        try:
            GemmSettings.configure(c.gemm)
            self.gemm = c.gemm
        except ValueError as exc:
            self._event(f"GEMM path {c.gemm} unavailable ({exc}); using the measured plan")
            GemmSettings.configure("auto")
            self.gemm = "auto"
        _, self.tokenizer, _ = load_tokenizer(c.model, progress=False)
        self._template = apply_chat_template
        if c.prompts:
            from tandem.tools.datasets import PromptRecord

            self.records = [PromptRecord(id=str(i), dataset="chaos", category=None, system=None, turns=[p])
                            for i, p in enumerate(c.prompts)]
        else:
            self.records = [r for r in load_prompts(dev_set(c.dataset)) if r.turns][: max(8, c.sessions * 2)]
        if c.netns:
            from tandem.tools.netns import NetnsTopology

            topo = NetnsTopology(verifiers=c.verifiers)
        else:
            topo = Topology(proxied=("drafter", "verifier"))
        os.environ.pop("TANDEM_REDIS_URL", None)
        self.stack = Stack(StackConfig(
            model=c.model, verifiers=c.verifiers, verifier_threads=c.verifier_threads, log_level="warning",
            metrics=False, topology=topo, http_port=8000 if c.netns else free_port(),
            grpc_port=50051 if c.netns else free_port(), startup_timeout_s=c.startup_timeout_s,
            drain_grace_s=2.0, restart_backoff_s=0.5, max_backoff_s=5.0, start_failures=5,
            extra_env={"TANDEM_GEMM": self.gemm}))
        previous = {}
        if threading.current_thread() is threading.main_thread():
            # Ctrl-C / SIGTERM end the soak early, with its report and a clean stop (a second
            # signal must not interrupt the stop and leave processes and namespaces behind).
            def early(signum, _frame):
                if not self._stop.is_set():
                    self.ended_early = True
                    self._event(f"{signal.Signals(signum).name}: ending the soak early")
                self._stop.set()

            previous = {sig: signal.signal(sig, early) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.stack.start()
        except BaseException:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            raise
        try:
            self.stack.supervise(lambda text: self._event(f"supervisor: {text}"))
            self._warm_up()
            baseline = self._probe()
            self._t0 = time.monotonic()
            workers = [threading.Thread(target=self._session_loop, args=(i,), daemon=True, name=f"session-{i}")
                       for i in range(c.sessions)]
            for w in workers:
                w.start()
            injector = threading.Thread(target=self._inject, daemon=True, name="faults")
            injector.start()
            self._stop.wait(c.duration_s)
            self._stop.set()
            self.ran_s = round(self._elapsed(), 1)
            injector.join(30)
            for w in workers:
                w.join(c.startup_timeout_s)
            self._settle()
            after = self._probe()
            restarts = dict(self.stack.restarts)
            events = list(self.stack.events)
        finally:
            self.stack.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        mismatches = self._check_greedy()
        return self._report(baseline, after, restarts, events, mismatches)

    def _event(self, text: str) -> None:
        log.info("%s", text)
        self.on_event(text)

    def _elapsed(self) -> float:
        return time.monotonic() - self._t0

    def _stub(self):
        import grpc

        from tandem.v1 import gateway_pb2_grpc

        channel = grpc.insecure_channel(self.stack.grpc_address)
        return channel, gateway_pb2_grpc.GatewayStub(channel)

    def _warm_up(self) -> None:
        channel, stub = self._stub()
        with channel:
            for i in range(self.config.verifiers):
                self._turn(stub, f"warm-{i}", 0, self._context([{"role": "user", "content": "Hello!"}]), 8, record=False)

    def _context(self, messages: list[dict]) -> list[int]:
        return list(self._template(self.tokenizer, messages))

    # -- sessions -------------------------------------------------------------------------------

    def _session_loop(self, worker: int) -> None:
        rng = random.Random(self.config.seed * 1000 + worker)
        channel, stub = self._stub()
        conversation = 0
        with channel:
            while not self._stop.is_set():
                record = rng.choice(self.records)
                session = f"chaos-{worker}-{conversation}"
                conversation += 1
                messages: list[dict] = [{"role": "system", "content": record.system}] if record.system else []
                prompts = (record.turns * self.config.turns)[: self.config.turns]
                for turn, prompt in enumerate(prompts):
                    if self._stop.is_set():
                        break
                    messages.append({"role": "user", "content": prompt})
                    out = self._turn(stub, session, turn, self._context(messages), self.config.max_tokens)
                    if out.error or not out.finish:
                        # The turn failed (explicitly): back off as a client honouring Retry-After
                        # would, then begin a new conversation.
                        self._stop.wait(rng.uniform(0.5, 1.5))
                        break
                    text = self.tokenizer.decode(self._output(out), skip_special_tokens=True)
                    messages.append({"role": "assistant", "content": text})

    def _output(self, out: Outcome) -> list[int]:
        """The completion's tokens (the stream never carries the stop token that ended it)."""
        return out.tokens

    def _turn(self, stub, session: str, turn: int, context: list[int], max_tokens: int, *, record: bool = True) -> Outcome:
        import grpc

        from tandem.v1 import common_pb2, gateway_pb2

        out = Outcome(session, turn, self._elapsed() if self._t0 else 0.0, context)
        req = gateway_pb2.GenerateRequest(
            session_id=session, prompt_ids=gateway_pb2.TokenIds(ids=context),
            sampling=common_pb2.SamplingParams(max_new_tokens=max_tokens),
            speculation=common_pb2.SpeculationParams(strategy=common_pb2.DRAFT_STRATEGY_NGRAM))
        start = last = time.monotonic()
        try:
            for msg in stub.Generate(req, timeout=120):
                now = time.monotonic()
                if msg.token_ids:
                    if msg.first_index != len(out.tokens):
                        out.index_faults += 1
                    if out.ttft_s is None:
                        out.ttft_s = now - start
                    else:
                        out.gaps.append((now - self._t0 if self._t0 else 0.0, (now - last) / len(msg.token_ids)))
                    last = now
                    out.tokens.extend(msg.token_ids)
                if msg.finish_reason == common_pb2.FINISH_REASON_STOP:
                    out.finish = "stop"
                elif msg.finish_reason == common_pb2.FINISH_REASON_LENGTH:
                    out.finish = "length"
                if msg.finish_reason:
                    out.resumed = msg.resumed
        except grpc.RpcError as exc:
            out.error = exc.code().name
        if record:
            with self._lock:
                self.outcomes.append(out)
        return out

    # -- faults ---------------------------------------------------------------------------------

    def _inject(self) -> None:
        c = self.config
        names = [f for f in c.faults if f in FAULTS]
        weights = [FAULTS[f] for f in names]
        k = 0
        while True:
            k += 1
            at = k * c.fault_every_s + self.rng.uniform(-0.2, 0.2) * c.fault_every_s
            if self._stop.wait(max(0.0, at - self._elapsed())):
                return
            for _ in range(8):  # a target still restarting from the last fault: draw another
                fault = self.rng.choices(names, weights)[0]
                verifier = f"verifier-{self.rng.randrange(c.verifiers)}"
                try:
                    target, restore = self._apply(fault, verifier)
                    break
                except Exception as exc:  # a fault that cannot be applied now is said, not fatal
                    self._event(f"fault {fault} not applied now: {exc}")
            else:
                continue
            self.faults.append({"at_s": round(self._elapsed(), 2), "fault": fault, "target": target})
            self._event(f"fault at {self._elapsed():.1f} s: {fault} ({target})")
            if restore is not None:
                threading.Timer(self.rng.uniform(2.0, 5.0), restore).start()

    def _apply(self, fault: str, verifier: str):
        stack = self.stack
        kind, _, what = fault.partition("-")
        if kind in ("kill", "term", "pause"):
            if what == "valkey":
                stack.valkey._process.kill()
                return "valkey", None
            name = verifier if what == "verifier" else what
            child = stack.child(name)
            if child.state != "up":
                raise RuntimeError(f"{name} is {child.state}")
            pid = child.proc.pid
            if kind == "pause":
                os.kill(pid, signal.SIGSTOP)
                return name, lambda: _signal(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
            return name, None
        link = stack.topology.links["drafter" if what == "drafter-link" else verifier]
        if kind == "delay":
            before = (link.rtt_ms, link.jitter_ms)
            rtt = self.rng.choice((30.0, 60.0, 120.0))
            link.set_delay(rtt, rtt / 5)
            return f"{link.name} {rtt:.0f} ms", lambda: link.set_delay(*before)
        link.drop()
        return link.name, None

    # -- after the run --------------------------------------------------------------------------

    def _settle(self, timeout_s: float = 60.0) -> None:
        """Wait until every child is up and nothing is in flight (a restart may still be running)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(ch.state == "up" for ch in self.stack.children):
                probe = self._probe()
                if not probe["active_generations"] and not probe["draft_sessions"] and not probe["gateway_in_flight"]:
                    return
            time.sleep(0.5)

    def _probe(self) -> dict:
        """What the leak checks read: per service RSS, verifiers' active generations and KV in use,
        the drafter's open sessions, the gateway's requests in flight, Redis residency keys."""
        import grpc
        import httpx
        import redis

        from tandem.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

        out = {"rss_mb": {}, "active_generations": 0, "kv_used_tokens": {}, "draft_sessions": 0,
               "gateway_in_flight": 0, "redis": {}}
        for ch in self.stack.children:
            out["rss_mb"][ch.name] = _rss_mb(ch.proc.pid)
        for i, address in enumerate(self.stack.verifier_addresses):
            try:
                with grpc.insecure_channel(address) as channel:
                    info = verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.InfoRequest(), timeout=5)
                out["active_generations"] += info.active_sessions
                out["kv_used_tokens"][f"verifier-{i}"] = info.kv_used_tokens
            except grpc.RpcError:
                out["kv_used_tokens"][f"verifier-{i}"] = None
        try:
            with grpc.insecure_channel(self.stack.drafter_address) as channel:
                out["draft_sessions"] = drafter_pb2_grpc.DrafterStub(channel).GetInfo(
                    drafter_pb2.DrafterInfoRequest(), timeout=5).active_sessions
        except grpc.RpcError:
            out["draft_sessions"] = None
        try:
            out["gateway_in_flight"] = httpx.get(f"{self.stack.http_url}/health", timeout=5).json()["requests_in_flight"]
        except (httpx.HTTPError, KeyError, ValueError):
            out["gateway_in_flight"] = None
        try:
            client = redis.Redis.from_url(self.stack.redis_url, decode_responses=True, socket_timeout=2)
            live = {k.rpartition(":")[2] for k in client.keys("tandem:v1:verifier:*")}
            keys = client.keys("tandem:v1:*")
            kinds = Counter(k.split(":")[2] for k in keys)
            without_ttl = [k for k in keys if client.pttl(k) < 0]
            stale_sessions = [k for k in client.keys("tandem:v1:session:*")
                              if client.hget(k, "verifier_id") not in live]
            stale_prefix = [k for k in client.keys("tandem:v1:prefix:*") if set(client.smembers(k)) - live]
            out["redis"] = {"keys": dict(kinds), "live_verifiers": sorted(live), "without_ttl": without_ttl,
                            "stale_sessions": len(stale_sessions), "stale_prefix_sets": len(stale_prefix)}
        except redis.RedisError as exc:
            out["redis"] = {"error": str(exc)}
        return out

    def _check_greedy(self) -> int:
        """Every completed response against plain decoding of the same context in this process;
        marks each outcome and returns the number of mismatches."""
        from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
        from tandem.engine.model.loading import load_model
        from tandem.engine.scheduler.generate import Engine

        engine = Engine(load_model(self.config.model))
        cache: dict[tuple[int, ...], list[int]] = {}
        mismatches = 0
        for out in self.outcomes:
            if out.error or not out.finish:
                continue
            key = tuple(out.context)
            if key not in cache:
                cache[key] = engine.generate(out.context, SamplingParams(max_new_tokens=self.config.max_tokens),
                                             SpecConfig(strategy=DraftStrategy.none)).token_ids
            got = self._output(out)
            out.mismatch = got != cache[key]
            if out.mismatch:
                out.diverged_at = next((i for i, (a, b) in enumerate(zip(got, cache[key])) if a != b),
                                       min(len(got), len(cache[key])))
                out.expected_len = len(cache[key])
            mismatches += out.mismatch
        return mismatches

    def _report(self, baseline: dict, after: dict, restarts: dict, events: list[str], mismatches: int) -> dict:
        outs = self.outcomes
        windows = [(f["at_s"], f["at_s"] + UNDER_FAULT_S) for f in self.faults]

        def faulty(t: float) -> bool:
            return any(a <= t <= b for a, b in windows)

        completed = [o for o in outs if not o.error and o.finish]
        ttft = {"calm": [o.ttft_s for o in outs if o.ttft_s is not None and not faulty(o.started)],
                "fault": [o.ttft_s for o in outs if o.ttft_s is not None and faulty(o.started)]}
        itl = {"calm": [g for o in outs for t, g in o.gaps if not faulty(t)],
               "fault": [g for o in outs for t, g in o.gaps if faulty(t)]}
        rss_growth = {name: (round(after["rss_mb"][name] / baseline["rss_mb"][name], 2)
                             if baseline["rss_mb"].get(name) and after["rss_mb"].get(name) else None)
                      for name in after["rss_mb"]}
        redis_after = after.get("redis", {})
        leaks = {
            "active_generations": after["active_generations"],
            "draft_sessions": after["draft_sessions"],
            "gateway_in_flight": after["gateway_in_flight"],
            "redis_keys_without_ttl": len(redis_after.get("without_ttl", [])) if "error" not in redis_after else None,
            "redis_stale_sessions": redis_after.get("stale_sessions"),
            "redis_stale_prefix_sets": redis_after.get("stale_prefix_sets"),
        }
        c = self.config
        report = {
            "config": {**asdict(c), "faults": list(c.faults), "gemm_used": self.gemm, "cpu": cpu_model()},
            "ran_s": self.ran_s,
            "ended_early": self.ended_early,
            "requests": len(outs),
            "completed": len(completed),
            "completed_after_failover": sum(1 for o in completed if o.resumed),
            "failed_explicit": sum(1 for o in outs if o.error),
            "errors": dict(Counter(o.error for o in outs if o.error)),
            "silent_truncations": sum(1 for o in outs if not o.error and not o.finish),
            "greedy_mismatches": mismatches,
            "mismatch_examples": [
                {"session": o.session, "turn": o.turn, "started_s": round(o.started, 1), "resumed": o.resumed,
                 "context_tokens": len(o.context), "tokens": len(o.tokens), "expected_tokens": o.expected_len,
                 "diverged_at": o.diverged_at, "finish": o.finish}
                for o in outs if o.mismatch][:40],
            "lost_or_duplicated_tokens": sum(o.index_faults for o in outs),
            "tokens": sum(len(o.tokens) for o in outs),
            "latency_ms": {
                f"{what}_{period}_p{q}": (None if (v := _pct(samples[period], q)) is None else round(v * 1000, 1))
                for what, samples in (("ttft", ttft), ("itl", itl)) for period in ("calm", "fault") for q in (50, 99)
            },
            "faults": self.faults,
            "fault_counts": dict(Counter(f["fault"] for f in self.faults)),
            "restarts": restarts,
            "supervisor_events": events,
            "leaks": leaks,
            "rss_mb": {"after_warm_up": baseline["rss_mb"], "after_run": after["rss_mb"], "growth": rss_growth},
            "redis_keys_after": redis_after.get("keys"),
            "kv_used_tokens_after": after["kv_used_tokens"],
        }
        report["ok"] = (report["silent_truncations"] == 0 and mismatches == 0
                        and report["lost_or_duplicated_tokens"] == 0
                        and not any(v is None or v for v in leaks.values()))  # None: could not be checked
        return report


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it died meanwhile (another fault): nothing to resume


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def table(report: dict) -> list[tuple[str, str]]:
    """The report's headline figures, as (what, value) rows for a terminal table or markdown."""
    lat = report["latency_ms"]

    def ms(key: str) -> str:
        return "-" if lat.get(key) is None else f"{lat[key]:.0f}"

    return [
        ("requests", str(report["requests"])),
        ("completed", str(report["completed"])),
        ("completed after failover", str(report["completed_after_failover"])),
        ("failed with an explicit error", f"{report['failed_explicit']} {report['errors'] or ''}".strip()),
        ("silent truncations", str(report["silent_truncations"])),
        ("greedy mismatches", str(report["greedy_mismatches"])),
        ("lost or duplicated tokens", str(report["lost_or_duplicated_tokens"])),
        ("faults", ", ".join(f"{k} {v}" for k, v in sorted(report["fault_counts"].items())) or "none"),
        ("restarts", ", ".join(f"{k} {v}" for k, v in sorted(report["restarts"].items()) if v) or "none"),
        ("TTFT p50 / p99 ms, calm", f"{ms('ttft_calm_p50')} / {ms('ttft_calm_p99')}"),
        ("TTFT p50 / p99 ms, under faults", f"{ms('ttft_fault_p50')} / {ms('ttft_fault_p99')}"),
        ("ITL p50 / p99 ms, calm", f"{ms('itl_calm_p50')} / {ms('itl_calm_p99')}"),
        ("ITL p50 / p99 ms, under faults", f"{ms('itl_fault_p50')} / {ms('itl_fault_p99')}"),
        ("leaks", ", ".join(f"{k} {'unknown' if v is None else v}" for k, v in report["leaks"].items()
                            if v is None or v) or "none"),
        ("RSS growth (after run / after warm-up)",
         ", ".join(f"{k} {v}x" for k, v in report["rss_mb"]["growth"].items() if v is not None)),
    ]


def run_chaos(config: ChaosConfig, on_event=None, out: Path | None = None) -> dict:
    report = Chaos(config, on_event).run()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    return report


__all__ = ["ChaosConfig", "FAULTS", "run_chaos", "table"]
