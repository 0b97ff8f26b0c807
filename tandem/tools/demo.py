"""The README's main job: real requests through a running stack's OpenAI-compatible API.

1. a streamed chat completion with speculation (text appears as it is verified): hybrid (prompt
   lookup or the distilled draft model, per block) when `tandem distill` has made a draft for the
   target, prompt lookup otherwise;
2. the same request decoded plainly, to compare speed and check the text is identical;
3. a second turn of the same session, which lands on the verifier holding its KV cache and
   prefills only the new tokens.
"""

from __future__ import annotations

import json
import time

import httpx
from rich.console import Console
from rich.table import Table

PROMPT = (
    "Here is a list of users as CSV:\nname,age,city\nAlice,30,Paris\nBob,25,Rome\nCarol,41,Oslo\n"
    "Convert it to a JSON array of objects with the keys name, age and city."
)
FOLLOW_UP = "Now add a field country to each object."


def _chat(client: httpx.Client, messages: list[dict], *, strategy: str, session: str, on_text=None) -> dict:
    """One streamed chat completion; returns text, usage, elapsed and time to first token."""
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": 120,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculation": {"strategy": strategy},
    }
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


def run_demo(http_url: str, console: Console, *, strategy: str = "ngram") -> bool:
    """The demo's requests; `strategy` is the speculative requests' (hybrid when the stack has a
    distilled draft model, else prompt lookup)."""
    out = Console()
    with httpx.Client(base_url=http_url, timeout=300.0) as client:
        models = client.get("/v1/models").json()
        console.print(f"[dim]models: {', '.join(m['id'] for m in models.get('data', []))}[/dim]")
        messages = [{"role": "user", "content": PROMPT}]
        console.print(f"\n[bold]user:[/bold] {PROMPT}\n")
        # Warm-up: the first request pays for allocation in every process.
        _chat(client, [{"role": "user", "content": "Hi"}], strategy="none", session="demo-warmup")
        console.print(f"[bold]assistant (speculative: {strategy}, streamed as verified):[/bold]")
        spec = _chat(client, messages, strategy=strategy, session="demo-1",
                     on_text=lambda t: out.print(t, end="", markup=False, highlight=False))
        out.print()
        plain = _chat(client, messages, strategy="none", session="demo-2")
        messages2 = messages + [{"role": "assistant", "content": spec["text"]},
                                {"role": "user", "content": FOLLOW_UP}]
        console.print(f"\n[bold]user (turn 2, same session):[/bold] {FOLLOW_UP}\n[bold]assistant:[/bold]")
        turn2 = _chat(client, messages2, strategy=strategy, session="demo-1",
                      on_text=lambda t: out.print(t, end="", markup=False, highlight=False))
        out.print()

    table = Table(title="Tandem through the gateway (one machine)")
    for col in ("request", "tokens", "tok/s", "TTFT ms", "accepted/drafted", "tok/step", "cached prompt"):
        table.add_column(col, justify="left" if col == "request" else "right")
    for name, r in (("plain", plain), (f"speculative ({strategy})", spec), ("turn 2", turn2)):
        u = r["usage"]
        s = u.get("speculation", {})
        n = u.get("completion_tokens", 0)
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        table.add_row(name, str(n), f"{n / r['seconds']:.1f}", f"{r['ttft'] * 1000:.0f}",
                      f"{s.get('accepted', 0)}/{s.get('drafted', 0)}", f"{s.get('mean_accepted_len', 0):.2f}",
                      f"{cached}/{u.get('prompt_tokens', 0)}")
    console.print(table)
    same = spec["text"] == plain["text"]
    # Decoding speed after the first token: the two requests share a prompt, and whichever runs
    # second finds its prefix KV resident (the table's cached column), so end-to-end time would
    # compare prefills, not decoding. TTFT is in the table.
    def decode_rate(r: dict) -> float:
        n = r["usage"].get("completion_tokens", 0)
        return max(n - 1, 0) / max(r["seconds"] - r["ttft"], 1e-9)

    console.print(
        f"decoding speedup over plain decoding (after the first token): "
        f"[bold]{decode_rate(spec) / max(decode_rate(plain), 1e-9):.2f}x[/bold]; "
        f"speculative text identical to plain decoding: {'[green]yes[/green]' if same else '[red]NO[/red]'}"
    )
    return same
