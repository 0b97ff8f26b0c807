"""The README's main job: real requests through a running stack's OpenAI-compatible API.

1. a streamed chat completion with speculation (text appears as it is verified): hybrid (prompt
   lookup or the distilled draft model, per block) when `tandem distill` has made a draft for the
   target, prompt lookup otherwise;
2. a second turn that edits the first answer (its prompt, the whole conversation, finds its KV
   resident and prefills only the new tokens), against the same request decoded plainly: three pairs in alternating order, both sides with the prompt's KV resident, reported as
   median and range, and the text checked identical in every pair.
"""

from __future__ import annotations

import json
import time

import httpx
from rich.console import Console
from rich.table import Table

from tandem.tools.bench import DID_NOT_SPECULATE, SPECULATED_MIN_DRAFTS_PER_REPLY
from tandem.tools.loadtest import stream_chat_body

PROMPT = (
    "Here is a list of users as CSV:\nname,age,city\nAlice,30,Paris\nBob,25,Rome\nCarol,41,Oslo\n"
    "Convert it to a JSON array of objects with the keys name, age and city."
)
FOLLOW_UP = "Now add a field country to each object."


def _chat(client: httpx.Client, messages: list[dict], *, strategy: str, session: str, on_text=None,
          max_tokens: int = 120) -> dict:
    """One streamed chat completion; returns text, usage, elapsed and time to first token."""
    body = stream_chat_body(messages, strategy=strategy, max_tokens=max_tokens)
    start = time.perf_counter()
    first = None
    text, usage = [], None
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"gateway answered {resp.status_code}: {resp.text}")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream failed: {chunk['error']}")
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    first = first or time.perf_counter()
                    text.append(delta)
                    if on_text is not None:
                        on_text(delta)
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    return {"text": "".join(text), "usage": usage or {}, "seconds": end - start,
            "ttft": (first or end) - start}


PAIRS = 3  # speculative / plain pairs measured, in alternating order


def decode_rate(r: dict) -> float:
    """Tokens per second after the first token: decoding, without the prefill."""
    n = r["usage"].get("completion_tokens", 0)
    return max(n - 1, 0) / max(r["seconds"] - r["ttft"], 1e-9)


def compare(pairs: list[tuple[dict, dict]]) -> dict:
    """Median and range of the speculative / plain ratios over pairs of the same request, and
    whether every pair's texts were identical and the speculative side really drafted."""
    import statistics

    decode = [decode_rate(s) / max(decode_rate(p), 1e-9) for s, p in pairs]
    overall = [p["seconds"] / max(s["seconds"], 1e-9) for s, p in pairs]
    drafted = [s["usage"].get("speculation", {}).get("drafted", 0) for s, _ in pairs]
    return {
        "decode_median": statistics.median(decode), "decode_min": min(decode), "decode_max": max(decode),
        "overall_median": statistics.median(overall),
        "identical": all(s["text"] == p["text"] for s, p in pairs),
        "speculated": statistics.median(drafted) >= SPECULATED_MIN_DRAFTS_PER_REPLY,
        "cached_equal": len({r["usage"].get("prompt_tokens_details", {}).get("cached_tokens") for pair in pairs
                             for r in pair}) == 1,
    }


def run_demo(http_url: str, console: Console, *, strategy: str = "ngram", prompt: str = PROMPT,
             follow_up: str = FOLLOW_UP, max_tokens: int = 120) -> bool:
    """The demo's requests; `strategy` is the speculative requests' (hybrid when the stack has a
    distilled draft model, else prompt lookup).

    Like for like: both kinds of request find the prompt's KV resident (a one-token request primes
    it, since the verifier shares prefixes across sessions), and they run as PAIRS pairs in
    alternating order, so neither side always runs first on a warmer machine."""
    out = Console()
    show = lambda t: out.print(t, end="", markup=False, highlight=False)  # noqa: E731
    with httpx.Client(base_url=http_url, timeout=300.0) as client:
        models = client.get("/v1/models").json()
        console.print(f"[dim]models: {', '.join(m['id'] for m in models.get('data', []))}[/dim]")
        # Warm-up: the first request pays for allocation in every process.
        _chat(client, [{"role": "user", "content": "Hi"}], strategy="none", session="demo-warmup")
        messages = [{"role": "user", "content": prompt}]
        console.print(f"\n[bold]user:[/bold] {prompt}\n")
        console.print(f"[bold]assistant (speculative: {strategy}, streamed as verified):[/bold]")
        turn1 = _chat(client, messages, strategy=strategy, session="demo-1", on_text=show, max_tokens=max_tokens)
        out.print()
        # The second turn edits the first answer: the agent-like case speculation is for. It is
        # measured against plain decoding of the same request, like for like: a one-token request
        # makes its prompt's KV resident for both sides (the verifier shares prefixes across
        # sessions), then PAIRS pairs in alternating order.
        messages2 = messages + [{"role": "assistant", "content": turn1["text"]},
                                {"role": "user", "content": follow_up}]
        console.print(f"\n[bold]user (turn 2):[/bold] {follow_up}\n[bold]assistant:[/bold]")
        _chat(client, messages2, strategy="none", session="demo-prime", max_tokens=1)
        pairs = []
        for i in range(PAIRS):
            runs = {}
            for kind in (("spec", "plain") if i % 2 == 0 else ("plain", "spec")):
                first = (kind, i) == ("spec", 0)
                runs[kind] = _chat(client, messages2, strategy=strategy if kind == "spec" else "none",
                                   session=f"demo-{kind}-{i}",
                                   on_text=show if first else None, max_tokens=max_tokens)
                if first:
                    out.print()
            pairs.append((runs["spec"], runs["plain"]))
        spec, plain = pairs[0]

    table = Table(title="Tandem through the gateway (one machine)")
    for col in ("request", "tokens", "tok/s", "TTFT ms", "accepted / drafted", "tok/step", "cached prompt"):
        table.add_column(col, justify="left" if col == "request" else "right", overflow="fold")
    for name, r in ((f"turn 1, {strategy}", turn1), ("turn 2, plain", plain), (f"turn 2, {strategy}", spec)):
        u = r["usage"]
        s = u.get("speculation", {})
        n = u.get("completion_tokens", 0)
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        table.add_row(name, str(n), f"{n / r['seconds']:.1f}", f"{r['ttft'] * 1000:.0f}",
                      f"{s.get('accepted', 0)} / {s.get('drafted', 0)}", f"{s.get('mean_accepted_len', 0):.2f}",
                      f"{cached}/{u.get('prompt_tokens', 0)}")
    console.print(table)
    c = compare(pairs)
    terms = "prompt KV resident for both" if c["cached_equal"] else "[yellow]unequal prompt caches[/yellow]"
    verdict = "" if c["speculated"] else f" [yellow]({DID_NOT_SPECULATE}: the ratio is noise)[/yellow]"
    console.print(
        f"turn 2, speculative ({strategy}) vs plain decoding of the same request, {PAIRS} pairs in alternating order, "
        f"{terms}: decoding after the first token [bold]{c['decode_median']:.2f}x[/bold] median "
        f"(range {c['decode_min']:.2f}-{c['decode_max']:.2f}x), whole request {c['overall_median']:.2f}x{verdict}; "
        f"text identical to plain decoding in every pair: "
        f"{'[green]yes[/green]' if c['identical'] else '[red]NO[/red]'}"
    )
    return c["identical"]
