"""`tandem loadtest`: concurrent multi-turn sessions against a running stack's OpenAI HTTP API.

For each concurrency c and for speculation off and on, c workers run conversations from the prompt
set in parallel, each conversation in its own session (`X-Session-Id`): turn 1 is the record's first
user message; every later turn appends the assistant's reply and the record's next user message, so
it should land on the verifier that holds the session and prefill only the new tokens. A phase ends
when every worker has finished its conversations or `duration` has passed (no new request starts
after that; running ones finish).

Per phase (JSON keys are fixed; the project is measured with them):
    tokens_per_s        completion tokens of the phase / its wall time (aggregate throughput)
    steady_tokens_per_s the same while every worker had a request in flight (no start, no tail;
                        `Phase.steady`), over `steady_window_s` seconds; null without such a window
    ttft_p50/p90/p99_ms time to the first streamed token, over requests
    itl_p50/p99_ms      inter-token latency: (last token time - first token time) / (tokens - 1),
                        per request (the time per output token a user sees after the first)
    acceptance_rate     accepted / drafted over the phase (null when nothing was drafted)
    residency_hit_rate  fraction of later turns whose prompt found cached KV (cached_tokens > 0)
    cached_share        prompt tokens found cached / all prompt tokens (the responses' usage)
    server              with --metrics (the verifiers' /metrics): what they did during the phase,
                        the prefill composition, recomputation of evicted KV, evictions, rows per
                        step, KV occupancy (SERVER_COUNTERS below)

The mixed workload (`run_mixed`, `tandem loadtest --mixed`): the same short conversations, twice
per concurrency: alone (the baseline), then while long prompts (4k-8k tokens, a few output tokens
each) arrive one after another. What a user of a running session feels while a long prompt is
prefilled is the gap between streamed chunks, so the report compares
    gap_p50/p99_ms          gaps between consecutive streamed chunks of the short requests
    gap_during_long_p99_ms  ... only the gaps that overlap a long prompt's prefill (its request
                            start to its first token)
    ttft_during_long_p99_ms TTFT of short requests that started during a long prefill
    long_ttft_ms            each long prompt's time to first token (~ its prefill)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx

from tandem.tools.datasets import PromptRecord


@dataclass
class RequestResult:
    turn: int
    ok: bool
    tokens: int = 0
    ttft_s: float | None = None
    itl_s: float | None = None
    drafted: int = 0
    accepted: int = 0
    cached_tokens: int = 0
    error: str | None = None
    start: float = 0.0  # perf_counter at the request's start
    chunks: list[float] = field(default_factory=list)  # perf_counter of each streamed content chunk
    prompt_tokens: int = 0
    worker: int = -1  # which of the phase's concurrent workers sent it
    end: float = 0.0  # perf_counter when it ended

    def gaps(self) -> list[tuple[float, float]]:
        """(from, to) of each gap between consecutive streamed chunks."""
        return list(zip(self.chunks, self.chunks[1:]))


@dataclass
class Phase:
    concurrency: int
    speculation: bool
    wall_s: float = 0.0
    results: list[RequestResult] = field(default_factory=list)
    server: "ServerView | None" = None  # with --metrics: what the verifiers did meanwhile

    def summary(self) -> dict:
        ok = [r for r in self.results if r.ok]
        tokens = sum(r.tokens for r in ok)
        drafted = sum(r.drafted for r in ok)
        later = [r for r in ok if r.turn > 0]
        return {
            "concurrency": self.concurrency,
            "speculation": self.speculation,
            "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_p50_ms": _pct([r.ttft_s for r in ok], 50),
            "ttft_p90_ms": _pct([r.ttft_s for r in ok], 90),
            "ttft_p99_ms": _pct([r.ttft_s for r in ok], 99),
            "itl_p50_ms": _pct([r.itl_s for r in ok], 50),
            "itl_p99_ms": _pct([r.itl_s for r in ok], 99),
            "acceptance_rate": sum(r.accepted for r in ok) / drafted if drafted else None,
            "residency_hit_rate": sum(1 for r in later if r.cached_tokens > 0) / len(later) if later else None,
            "cached_share": (sum(r.cached_tokens for r in ok) / prompt) if (prompt := sum(r.prompt_tokens for r in ok))
            else None,
            "requests": len(self.results),
            "errors": len(self.results) - len(ok),
            # what went wrong, said once: the most frequent failure and how often (None: no failure)
            "top_error": _top_error(self.results),
            "completion_tokens": tokens,
            "wall_s": self.wall_s,
            **self.steady(),
            **({"server": self.server.summary()} if self.server is not None else {}),
        }

    def steady(self) -> dict:
        """Throughput while every worker had a request in flight: from the last worker's first
        request start to the first worker's last request end (before: workers still starting;
        after: the phase's tail, fewer than `concurrency` sessions left). A request's tokens are
        spread evenly over its streamed chunks and the chunks inside the window count.

        `tokens_per_s` (the whole phase) holds that tail: with a few conversations a worker, the
        phase's last seconds run at a fraction of its concurrency.
        """
        by_worker: dict[int, list[RequestResult]] = {}
        for r in self.results:
            by_worker.setdefault(r.worker, []).append(r)
        if len(by_worker) < self.concurrency or -1 in by_worker:
            return {"steady_tokens_per_s": None, "steady_window_s": None}
        start = max(min(r.start for r in rs) for rs in by_worker.values())
        end = min(max(r.end for r in rs) for rs in by_worker.values())
        if end <= start:
            return {"steady_tokens_per_s": None, "steady_window_s": None}
        tokens = sum(r.tokens / len(r.chunks) * sum(1 for t in r.chunks if start <= t <= end)
                     for r in self.results if r.ok and r.chunks)
        return {"steady_tokens_per_s": tokens / (end - start), "steady_window_s": end - start}


# What the verifiers did during a phase (`--metrics`: their Prometheus endpoints, scraped before and
# after it, the gauges every SAMPLE_S during it), summed over verifiers:
#   prefill_computed/reused_tokens  context tokens computed at prefill / found resident (own or shared)
#   prefix_shared_tokens            of reused: copied from another session of the tenant
#   recomputed_tokens               of computed: tokens an eviction had taken from their session
#   recomputed_share                recomputed_tokens / prefill_computed_tokens
#   evictions                       idle sessions evicted for room
#   steps, rows_per_step            target forwards and the mean sequences in each
#   kv_used_max/mean_tokens         KV held by resident sessions (of kv_capacity_tokens)
#   admission_waiting_max           requests waiting for KV room at once
SERVER_COUNTERS = {
    "prefill_computed_tokens": ("tandem_prefill_tokens_total", ("kind", "computed")),
    "prefill_reused_tokens": ("tandem_prefill_tokens_total", ("kind", "reused")),
    "prefix_shared_tokens": ("tandem_prefix_shared_tokens_total", None),
    "recomputed_tokens": ("tandem_prefill_recomputed_tokens_total", None),
    "evictions": ("tandem_kv_evictions_total", None),
    "steps": ("tandem_verify_batch_size_count", None),
    "rows": ("tandem_verify_batch_size_sum", None),
}
SERVER_GAUGES = {"kv_used": "tandem_kv_used_tokens", "kv_capacity": "tandem_kv_capacity_tokens",
                 "admission_waiting": "tandem_admission_waiting", "resident": "tandem_resident_sessions"}
SAMPLE_S = 0.5


async def _scrape(client: httpx.AsyncClient, urls: list[str]) -> dict[str, float]:
    """Counters and gauges of SERVER_COUNTERS / SERVER_GAUGES, summed over the endpoints."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for url in urls:
        text = (await client.get(url, timeout=10)).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for key, (name, label) in SERVER_COUNTERS.items():
                    if name == sample.name and (label is None or sample.labels.get(label[0]) == label[1]):
                        out[key] = out.get(key, 0.0) + sample.value
                for key, name in SERVER_GAUGES.items():
                    if name == sample.name:
                        out[key] = out.get(key, 0.0) + sample.value
    return out


@dataclass
class ServerView:
    """The verifiers' counters over a phase and their gauges sampled during it."""

    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    samples: list[dict[str, float]] = field(default_factory=list)

    def summary(self) -> dict:
        d = {k: self.after.get(k, 0.0) - self.before.get(k, 0.0) for k in SERVER_COUNTERS}
        # the samples, and the end (a phase shorter than SAMPLE_S may have no sample under load)
        used = [s.get("kv_used", 0.0) for s in [*self.samples, self.after]]
        computed = d["prefill_computed_tokens"]
        return {
            **{k: int(v) for k, v in d.items() if k != "rows"},
            "recomputed_share": round(d["recomputed_tokens"] / computed, 4) if computed else 0.0,
            "rows_per_step": round(d["rows"] / d["steps"], 2) if d["steps"] else None,
            "kv_used_max_tokens": int(max(used)),
            "kv_used_mean_tokens": int(sum(used) / len(used)),
            "kv_capacity_tokens": int(self.after.get("kv_capacity", 0)),
            "admission_waiting_max": int(max((s.get("admission_waiting", 0.0) for s in self.samples), default=0)),
            "resident_sessions_max": int(max((s.get("resident", 0.0) for s in self.samples), default=0)),
        }


async def _watch(client: httpx.AsyncClient, urls: list[str], view: ServerView, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            view.samples.append(await _scrape(client, urls))
        except (httpx.HTTPError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_S)
        except asyncio.TimeoutError:
            pass


def _top_error(results: list[RequestResult]) -> str | None:
    errors = Counter(r.error for r in results if not r.ok)
    if not errors:
        return None
    text, n = errors.most_common(1)[0]
    return f"{text} ({n} of {sum(errors.values())} failures)"


def _overlaps(a: float, b: float, windows: list[tuple[float, float]]) -> bool:
    return any(a < f and b > s for s, f in windows)


@dataclass
class MixedPhase:
    """Short conversations at one concurrency with (or without) long prompts arriving."""

    short: Phase
    long: list[RequestResult] = field(default_factory=list)

    def windows(self) -> list[tuple[float, float]]:
        """Each long prompt's prefill: its start to its first token (or its end, failed)."""
        return [(r.start, r.chunks[0] if r.chunks else r.start + (r.ttft_s or 0.0)) for r in self.long]

    def summary(self) -> dict:
        ok = [r for r in self.short.results if r.ok]
        windows = self.windows()
        gaps = [b - a for r in ok for a, b in r.gaps()]
        during = [b - a for r in ok for a, b in r.gaps() if _overlaps(a, b, windows)]
        started_during = [r.ttft_s for r in ok if any(s <= r.start < f for s, f in windows)]
        long_ok = [r for r in self.long if r.ok]
        return {
            **self.short.summary(),
            "long_prompts": len(self.long),
            "long_errors": len(self.long) - len(long_ok),
            "long_prompt_tokens": [r.prompt_tokens for r in long_ok],
            "long_ttft_ms": [round(r.ttft_s * 1000.0, 1) for r in long_ok if r.ttft_s is not None],
            "gap_p50_ms": _pct(gaps, 50),
            "gap_p99_ms": _pct(gaps, 99),
            "gap_during_long_p99_ms": _pct(during, 99),
            "gaps_during_long": len(during),
            "ttft_during_long_p50_ms": _pct(started_during, 50),
            "ttft_during_long_p99_ms": _pct(started_during, 99),
            "requests_started_during_long": len(started_during),
        }


def long_prompt(records: list[PromptRecord], tokens: int, nonce: str) -> list[dict]:
    """A chat of about `tokens` tokens (4 characters a token for English text: the report gives the
    true count), built from the prompt set's text, unique by `nonce` so no prefix is shared."""
    parts, size = [f"Document {nonce}."], 0
    pool = itertools.cycle([t for r in records for t in r.turns] or ["The quick brown fox jumps over the lazy dog."])
    while size < tokens * 4:
        text = next(pool)
        parts.append(text)
        size += len(text) + 1
    return [{"role": "user", "content": "\n".join(parts) + "\nSummarise the document above in one sentence."}]


def stream_chat_body(messages: list[dict], *, strategy: str, max_tokens: int) -> dict:
    """A greedy streamed chat completion that reports usage at the end (the gateway's OpenAI API)."""
    return {
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculation": {"strategy": strategy},
    }


def _pct(values: list[float | None], q: float) -> float | None:
    """The q-th percentile in milliseconds (nearest rank); None without values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    rank = max(0, min(len(xs) - 1, int(round(q / 100 * len(xs) + 0.5)) - 1))
    return xs[rank] * 1000.0


async def _one_request(client: httpx.AsyncClient, session: str, messages: list[dict], *, speculation: bool,
                       max_tokens: int, turn: int, strategy: str = "ngram") -> tuple[RequestResult, str]:
    body = stream_chat_body(messages, strategy=strategy if speculation else "none", max_tokens=max_tokens)
    start = time.perf_counter()
    first = last = None
    chunks: list[float] = []
    parts: list[str] = []
    usage: dict = {}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"X-Session-Id": session}) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return RequestResult(turn, False, error=f"HTTP {resp.status_code}: {resp.text[:200]}"), ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(turn, False, error=str(chunk["error"])[:200]), ""
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        chunks.append(now)
                        parts.append(choice["delta"]["content"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as exc:
        return RequestResult(turn, False, error=f"{type(exc).__name__}: {exc}"), ""
    n = int(usage.get("completion_tokens", 0))
    spec = usage.get("speculation") or {}
    itl = (last - first) / (n - 1) if first is not None and last is not None and n > 1 else None
    return RequestResult(
        turn, True, tokens=n, ttft_s=(first - start) if first else None, itl_s=itl,
        drafted=int(spec.get("drafted", 0)), accepted=int(spec.get("accepted", 0)),
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)),
        start=start, chunks=chunks, prompt_tokens=int(usage.get("prompt_tokens", 0)),
    ), "".join(parts)


async def _worker(client, conversations, phase: Phase, *, speculation: bool, turns: int, max_tokens: int,
                  deadline: float, strategy: str = "ngram", worker: int = -1) -> None:
    for rec in conversations:
        if time.monotonic() >= deadline:
            return
        session = f"loadtest-{uuid.uuid4().hex[:12]}"
        messages: list[dict] = [{"role": "system", "content": rec.system}] if rec.system else []
        for t, user in enumerate(rec.turns[:turns]):
            if time.monotonic() >= deadline:
                return
            messages.append({"role": "user", "content": user})
            result, reply = await _one_request(client, session, messages, speculation=speculation,
                                               max_tokens=max_tokens, turn=t, strategy=strategy)
            result.worker, result.end = worker, time.perf_counter()
            phase.results.append(result)
            if not result.ok:
                break
            messages.append({"role": "assistant", "content": reply})


async def run_phase(base_url: str, records: list[PromptRecord], concurrency: int, speculation: bool, *,
                    turns: int, max_tokens: int, duration_s: float, conversations_per_worker: int,
                    strategy: str = "ngram", metrics_urls: list[str] | None = None) -> Phase:
    """One concurrency level, speculation on or off: `concurrency` workers, each running
    `conversations_per_worker` conversations (records taken round-robin), bounded by `duration_s`.
    `metrics_urls`: the verifiers' Prometheus endpoints, for the phase's server view."""
    phase = Phase(concurrency, speculation)
    pool = itertools.cycle(records)
    plans = [[next(pool) for _ in range(conversations_per_worker)] for _ in range(concurrency)]
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client, \
            httpx.AsyncClient() as scraper:
        if metrics_urls:
            phase.server = ServerView(before=await _scrape(scraper, metrics_urls))
            stop = asyncio.Event()
            watcher = asyncio.create_task(_watch(scraper, metrics_urls, phase.server, stop))
        start = time.perf_counter()
        deadline = time.monotonic() + duration_s
        await asyncio.gather(*(
            _worker(client, plan, phase, speculation=speculation, turns=turns, max_tokens=max_tokens,
                    deadline=deadline, strategy=strategy, worker=i)
            for i, plan in enumerate(plans)
        ))
        phase.wall_s = time.perf_counter() - start
        if metrics_urls:
            stop.set()
            await watcher
            phase.server.after = await _scrape(scraper, metrics_urls)
    return phase


def _each_reported(phases, on_phase) -> list[dict]:
    """Run the phases (a generator: one runs at a time) and hand each summary to `on_phase` as it
    ends, so a long sweep shows its progress."""
    out = []
    for summary in phases:
        out.append(summary)
        if on_phase is not None:
            on_phase(summary)
    return out


def run_loadtest(base_url: str, records: list[PromptRecord], concurrencies: list[int], *, turns: int = 2,
                 max_tokens: int = 64, duration_s: float = 120.0, conversations_per_worker: int = 1,
                 on_phase=None, strategy: str = "ngram", metrics_urls: list[str] | None = None) -> dict:
    """Every concurrency, speculation off then on (interleaved per concurrency, so machine noise
    hits both alike); speculation on = the draft strategy `strategy`. Returns {"results": [...],
    "config": {...}}."""
    phases = (asyncio.run(run_phase(base_url, records, c, speculation, turns=turns, max_tokens=max_tokens,
                                    duration_s=duration_s, conversations_per_worker=conversations_per_worker,
                                    strategy=strategy, metrics_urls=metrics_urls)).summary()
              for c in concurrencies for speculation in (False, True))
    return {
        "results": _each_reported(phases, on_phase),
        "config": {"endpoint": base_url, "turns": turns, "max_tokens": max_tokens, "duration_s": duration_s,
                   "conversations_per_worker": conversations_per_worker, "prompts": len(records),
                   "strategy": strategy},
    }


async def _long_driver(client, records, phase: MixedPhase, *, speculation: bool, tokens: list[int], gap_s: float,
                       max_tokens: int, deadline: float) -> None:
    """Long prompts one after another, `gap_s` apart, until the phase's deadline."""
    for n in itertools.cycle(tokens):
        await asyncio.sleep(gap_s)
        if time.monotonic() >= deadline:
            return
        messages = long_prompt(records, n, uuid.uuid4().hex[:12])
        result, _ = await _one_request(client, f"loadtest-long-{uuid.uuid4().hex[:12]}", messages,
                                       speculation=speculation, max_tokens=max_tokens, turn=0)
        phase.long.append(result)


async def run_mixed_phase(base_url: str, records: list[PromptRecord], concurrency: int, speculation: bool, *,
                          long_tokens: list[int], long_gap_s: float, turns: int, max_tokens: int,
                          duration_s: float) -> MixedPhase:
    """`run_phase` plus (when `long_tokens`) a driver sending long prompts meanwhile. The short
    workers run until the deadline (conversations repeat), so long prompts meet running streams."""
    phase = MixedPhase(Phase(concurrency, speculation))
    pool = itertools.cycle(records)
    plans = [(next(pool) for _ in itertools.count()) for _ in range(concurrency)]
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(900.0), limits=limits) as client:
        start = time.perf_counter()
        deadline = time.monotonic() + duration_s
        tasks = [_worker(client, plan, phase.short, speculation=speculation, turns=turns, max_tokens=max_tokens,
                         deadline=deadline) for plan in plans]
        if long_tokens:
            tasks.append(_long_driver(client, records, phase, speculation=speculation, tokens=long_tokens,
                                      gap_s=long_gap_s, max_tokens=8, deadline=deadline))
        await asyncio.gather(*tasks)
        phase.short.wall_s = time.perf_counter() - start
    return phase


def run_mixed(base_url: str, records: list[PromptRecord], concurrencies: list[int], *, long_tokens: list[int],
              long_gap_s: float = 3.0, turns: int = 2, max_tokens: int = 64, duration_s: float = 120.0,
              speculation: tuple[bool, ...] = (False, True), on_phase=None) -> dict:
    """The mixed workload: per concurrency and speculation setting, the short conversations alone
    (baseline) then with long prompts arriving. Returns {"mixed": [...], "config": {...}}."""
    phases = ({**asyncio.run(run_mixed_phase(
                   base_url, records, c, spec, long_tokens=longs, long_gap_s=long_gap_s, turns=turns,
                   max_tokens=max_tokens, duration_s=duration_s)).summary(), "with_long": bool(longs)}
              for c in concurrencies for spec in speculation for longs in ([], long_tokens))
    return {
        "mixed": _each_reported(phases, on_phase),
        "config": {"endpoint": base_url, "turns": turns, "max_tokens": max_tokens, "duration_s": duration_s,
                   "prompts": len(records), "long_tokens": long_tokens, "long_gap_s": long_gap_s},
    }


def plot_loadtest(result: dict, path: str, *, title: str = "") -> None:
    """Throughput and inter-token latency against concurrency, speculation on vs off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for spec, style in ((False, "o--"), (True, "s-")):
        rows = sorted((r for r in result["results"] if r["speculation"] == spec), key=lambda r: r["concurrency"])
        label = f"speculation on ({result.get('config', {}).get('strategy', 'ngram')})" if spec else "speculation off"
        xs = [r["concurrency"] for r in rows]
        ax1.plot(xs, [r["tokens_per_s"] for r in rows], style, label=label)
        ax2.plot(xs, [r["itl_p50_ms"] or 0 for r in rows], style, label=label + " p50")
        ax2.plot(xs, [r["itl_p99_ms"] or 0 for r in rows], style, alpha=0.4, label=label + " p99")
    ax1.set(xlabel="concurrent sessions", ylabel="completion tokens / s (all sessions)", title="Aggregate throughput")
    ax2.set(xlabel="concurrent sessions", ylabel="inter-token latency (ms)", title="Inter-token latency")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in result["results"]}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    cfg = result.get("config", {})
    fig.suptitle(title or "tandem loadtest")
    fig.text(0.5, 0.01, f"{cfg.get('turns')} turns per session, {cfg.get('max_tokens')} max tokens per turn, "
             f"greedy; {cfg.get('endpoint')}", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
