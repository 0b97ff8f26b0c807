"""`tandem determinism`: the same request gives the same tokens idle and under a hostile load.

An agent platform replays workflows and compares runs, so a greedy request must give the same token
ids at 3 a.m. and at peak. This starts its own stack (tandem/tools/stack.py: Valkey, a drafter, by
default two verifiers and the gateway as processes on loopback; `tls`/`api_keys` as `tandem up`
runs them), then:

1. idle: each request of the set alone, one after another, with strategy `none` (plain decoding of
   the target): the reference token ids;
2. rounds: every request again, all at once, each stream with a strategy from the list (rotated per
   round so every strategy meets every prompt), beside a hostile mix: another tenant's long prompts
   (forcing chunked prefill of their pieces among the streams' steps), a request with n > 1 whose
   every choice must equal the reference, and in every `kill_every`-th round a SIGKILL of a
   verifier while streams run on it (the gateway resumes them on the other; a resumed stream must
   equal the idle one too).

The chat requests share a system prompt, so their prompts share a prefix: its KV is computed once
and shared between sessions (with `tools`, long enough to be read in place rather than copied), and each prompt is prefilled in whatever pieces the load allows,
which is what made chat output differ under load before every position's bits were made
independent of how it arrived (docs/history.md, "One request, one answer").

Seeded sampled requests (`sampled`) are compared with their own idle run. Only their plain (`none`)
form is required to replay under load; the report counts two others separately: with speculation a
request's draws follow its verification blocks, which follow the drafter's state (suffix decoding's
store learns every answer, so a later run drafts other blocks) and can be shortened under load when
the drafter's proposal is late (a fallback step); and a request resumed on another verifier after a
kill continues with a seed derived from the resume point (services/gateway/core.py), by design.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.engine.native.build import cpu_model

log = logging.getLogger("tandem.tools.determinism")

STRATEGIES = ("none", "ngram", "suffix", "hybrid")
SYSTEM = "You are a helpful assistant. Answer clearly and concisely."


def system_prompt(tools: int) -> str:
    """The streams' shared system prompt; with `tools`, an agent's tool list of that many
    signatures after it (40: ~700 tokens), long enough that the sessions read whole attention runs
    of it from one storage (llama.KVPrefix) rather than copies."""
    if not tools:
        return SYSTEM
    lines = [f"def tool_{i}(path: str, limit: int = {i}) -> list[str]: \"\"\"Read {i} lines of a file.\"\"\""
             for i in range(tools)]
    return SYSTEM + "\nYou can call these tools:\n" + "\n".join(lines)
TENANTS = ("replay", "other")  # the streams' tenant and the hostile one (with api_keys)
HOSTILE_TOKENS = 8  # tokens each long prompt generates


@dataclass
class DeterminismConfig:
    model: str = "default"
    draft_model: str | None = None  # for hybrid and model (None: the target's distilled draft, if made)
    rounds: int = 5
    streams: int = 8  # concurrent greedy chat streams of one tenant
    strategies: tuple[str, ...] = STRATEGIES
    max_tokens: int = 48
    long_prompts: int = 2  # another tenant's long prompts per round
    long_words: int = 900  # words of each long prompt (~1,200 tokens)
    n_choices: int = 2  # one request with this many choices per round (1: none)
    sampled: bool = True  # seeded sampled requests beside the greedy ones
    verifiers: int = 2
    kill_every: int = 2  # SIGKILL a verifier mid-stream in every k-th round (0: never)
    tls: bool = False
    api_keys: bool = False  # two tenants with keys; the streams use one, the hostile mix the other
    tools: int = 0  # tools listed in the shared system prompt (an agent's tool list: ~18 tokens each)
    dataset: str = "mt_bench"
    prompts: tuple[str, ...] = ()  # user turns instead of the dataset's
    seed: int = 0
    verifier_threads: int | None = None
    startup_timeout_s: float = 300.0
    extra_env: dict[str, str] = field(default_factory=dict)


@dataclass
class Request:
    name: str
    prompt: str
    strategy: str = "none"
    temperature: float = 0.0
    seed: int | None = None
    n: int = 1


@dataclass
class Result:
    name: str
    strategy: str
    choices: list[list[int]]
    finish: list[str]
    error: str | None = None
    resumed: int = 0
    round: int = -1


class Determinism:
    def __init__(self, config: DeterminismConfig, on_event=None):
        self.config = config
        self.on_event = on_event or (lambda text: None)
        self.rng = random.Random(config.seed)
        self.kills: list[dict] = []
        self._live: dict[str, str] = {}  # session -> the verifier its last chunk came from, while it streams
        self._lock = threading.Lock()

    def _event(self, text: str) -> None:
        log.info("%s", text)
        self.on_event(text)

    # -- requests -------------------------------------------------------------------------------

    def _prompts(self) -> list[str]:
        c = self.config
        if c.prompts:
            return list(c.prompts)
        from tandem.tools.datasets import dev_set, load_prompts

        return [r.turns[0] for r in load_prompts(dev_set(c.dataset)) if r.turns][: max(c.streams, 2)]

    def _long_prompt(self, prompts: list[str], k: int) -> str:
        words: list[str] = []
        i = k
        while len(words) < self.config.long_words:
            words.extend(prompts[i % len(prompts)].split())
            i += 1
        return "Summarize the following notes in one sentence.\n\n" + " ".join(words[: self.config.long_words])

    def _send(self, stub, req: Request, session: str, key: str | None, round_: int = -1,
              max_tokens: int | None = None) -> Result:
        import grpc

        from tandem.contract.params import DraftStrategy
        from tandem.serving.protoconv import STRATEGY_TO_PB
        from tandem.v1 import common_pb2, gateway_pb2

        sampling = common_pb2.SamplingParams(max_new_tokens=max_tokens or self.config.max_tokens,
                                             temperature=req.temperature)
        if req.seed is not None:
            sampling.seed = req.seed
        msgs = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="system", content=system_prompt(self.config.tools)),
                                                  gateway_pb2.ChatMessage(role="user", content=req.prompt)])
        grpc_req = gateway_pb2.GenerateRequest(
            session_id=session if req.n == 1 else "",  # several continuations are no one session's
            messages=msgs, sampling=sampling, n=req.n,
            speculation=common_pb2.SpeculationParams(strategy=STRATEGY_TO_PB[DraftStrategy(req.strategy)]))
        out = Result(req.name, req.strategy, [[] for _ in range(req.n)], [""] * req.n, round=round_)
        metadata = [("authorization", f"Bearer {key}")] if key else None
        try:
            for msg in stub.Generate(grpc_req, timeout=600, metadata=metadata):
                toks = out.choices[msg.choice]
                if msg.verifier_id and not msg.finish_reason:
                    with self._lock:
                        self._live[session] = msg.verifier_id
                if msg.token_ids:
                    if msg.first_index != len(toks):
                        raise RuntimeError(f"{req.name}: chunk at {msg.first_index} after {len(toks)} tokens")
                    toks.extend(msg.token_ids)
                if msg.finish_reason:
                    out.finish[msg.choice] = common_pb2.FinishReason.Name(msg.finish_reason)
                    out.resumed = max(out.resumed, msg.resumed)
        except grpc.RpcError as exc:
            out.error = f"{exc.code().name}: {exc.details()}"
        finally:
            with self._lock:
                self._live.pop(session, None)
        return out

    # -- the run --------------------------------------------------------------------------------

    def run(self) -> dict:
        with tempfile.TemporaryDirectory(prefix="tandem-determinism-") as workdir:
            return self._run(Path(workdir))

    def _run(self, workdir: Path) -> dict:
        """The run, its certificates and key file in `workdir` (removed after it)."""
        from tandem.tools.stack import Stack, StackConfig, free_port, grpc_channel
        from tandem.v1 import gateway_pb2_grpc

        c = self.config
        unknown = sorted(set(c.strategies) - set(STRATEGIES) - {"model"})
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}, model")
        draft = c.draft_model or find_draft(c.model)
        if draft is None and set(c.strategies) & {"hybrid", "model"}:
            raise ValueError("strategies hybrid and model need a draft model: pass one, make the target's with "
                             "`tandem distill`, or leave them out")
        keys = {t: f"sk-{t}-{secrets.token_hex(16)}" for t in TENANTS} if c.api_keys else {}
        keys_file = None
        if keys:
            keys_file = workdir / "keys.json"
            keys_file.write_text(json.dumps({"tenants": {t: {"keys": [k]} for t, k in keys.items()}}))
        os.environ.pop("TANDEM_REDIS_URL", None)
        stack = Stack(StackConfig(
            model=c.model, draft_model=draft, verifiers=c.verifiers, verifier_threads=c.verifier_threads, log_level="warning",
            metrics=False, http_port=free_port(), grpc_port=free_port(), startup_timeout_s=c.startup_timeout_s,
            drain_grace_s=2.0, restart_backoff_s=0.5, max_backoff_s=5.0, start_failures=5,
            tls_dir=workdir / "certs" if c.tls else None, api_keys_file=keys_file, extra_env=dict(c.extra_env)))
        prompts = self._prompts()
        chat = [Request(f"chat-{i}", prompts[i % len(prompts)]) for i in range(c.streams)]
        sampled = [Request(f"sampled-{i}", prompts[i % len(prompts)], temperature=0.8, seed=1000 + i)
                   for i in range(2)] if c.sampled else []
        t0 = time.monotonic()
        stack.start()
        try:
            stack.supervise(lambda text: self._event(f"supervisor: {text}"))
            with grpc_channel(stack.grpc_address, stack.ca) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                key, other_key = keys.get(TENANTS[0]), keys.get(TENANTS[1])
                self._event(f"idle: {len(chat)} greedy chat requests, one at a time (strategy none)")
                idle = {r.name: self._send(stub, r, f"idle-{r.name}", key) for r in chat}
                idle_sampled = {}
                for r in sampled:
                    for strategy in c.strategies:
                        rq = Request(r.name, r.prompt, strategy, r.temperature, r.seed)
                        idle_sampled[(r.name, strategy)] = self._send(stub, rq, f"idle-{r.name}-{strategy}", key)
                bad = [f"{n}: {res.error}" for n, res in idle.items() if res.error]
                if bad:
                    raise RuntimeError(f"idle requests failed: {bad}")
                rounds = [self._round(stub, k, chat, sampled, prompts, stack, key, other_key)
                          for k in range(c.rounds)]
        finally:
            stack.stop()
        return self._report(idle, idle_sampled, rounds, time.monotonic() - t0)

    def _round(self, stub, k: int, chat: list[Request], sampled: list[Request], prompts: list[str], stack,
               key: str | None, other_key: str | None) -> dict:
        c = self.config
        salt = f"r{k}-{self.rng.getrandbits(32):08x}"  # fresh session ids: nothing of the idle run is resumed
        work: list[tuple[Request, str, str | None]] = []
        for i, r in enumerate(chat):
            strategy = c.strategies[(i + k) % len(c.strategies)]
            work.append((Request(r.name, r.prompt, strategy), f"{salt}-{r.name}", key))
        if c.n_choices > 1:
            r = chat[k % len(chat)]
            work.append((Request(f"{r.name}", r.prompt, c.strategies[k % len(c.strategies)], n=c.n_choices),
                         f"{salt}-n-{r.name}", key))
        for r in sampled:
            strategy = c.strategies[k % len(c.strategies)]
            work.append((Request(r.name, r.prompt, strategy, r.temperature, r.seed), f"{salt}-{r.name}", key))
        hostile = [(Request(f"long-{j}", self._long_prompt(prompts, j + k), "none"), f"{salt}-long-{j}", other_key)
                   for j in range(c.long_prompts)]
        results: list[Result | None] = [None] * len(work)
        threads = []
        for r, session, kk in hostile:
            # the long prompts first, so the streams' prompts are prefilled beside their pieces; a
            # few tokens each: what they are for is their prefill
            threads.append(threading.Thread(target=self._send, args=(stub, r, session, kk, k, HOSTILE_TOKENS),
                                            daemon=True))
        for j, (r, session, kk) in enumerate(work):
            def one(j=j, r=r, session=session, kk=kk):
                results[j] = self._send(stub, r, session, kk, k)
            threads.append(threading.Thread(target=one, daemon=True))
        for t in threads:
            t.start()
            time.sleep(0.02)
        killed = None
        if c.kill_every and (k + 1) % c.kill_every == 0 and c.verifiers > 1:
            killed = self._kill(stack)
        for t in threads:
            t.join(600)
        self._event(f"round {k + 1}/{c.rounds}: {len(work)} requests beside {len(hostile)} long prompts"
                    + (f", {killed} killed" if killed else ""))
        return {"round": k, "killed": killed, "results": [asdict(r) for r in results if r is not None]}

    def _kill(self, stack) -> str | None:
        """SIGKILL the verifier that streams the most requests of this round right now (waiting up
        to a minute for the first tokens), so the kill cuts streams mid-way."""
        names = [ch.name for ch in stack.children if ch.name.startswith("verifier") and ch.state == "up"]
        if not names:
            return None
        deadline = time.monotonic() + 60.0

        def serving_now() -> list[str]:
            with self._lock:
                return [v for v in self._live.values() if v in names]

        while not serving_now() and time.monotonic() < deadline:  # the round's first tokens
            time.sleep(0.02)
        # then a random moment while streams run (short: a round of short replies ends in ~1 s)
        time.sleep(self.rng.uniform(0.05, 0.4))
        serving = serving_now()
        name = max(names, key=lambda n: (serving.count(n), self.rng.random())) if serving else self.rng.choice(names)
        os.kill(stack.child(name).proc.pid, signal.SIGKILL)
        self.kills.append({"verifier": name})
        # wait until the supervisor has it back, so the next round starts with every verifier
        deadline = time.monotonic() + self.config.startup_timeout_s
        time.sleep(1.0)
        while time.monotonic() < deadline and stack.child(name).state != "up":
            time.sleep(0.5)
        return name

    # -- the report -----------------------------------------------------------------------------

    def _report(self, idle: dict, idle_sampled: dict, rounds: list[dict], seconds: float) -> dict:
        greedy = {"compared": 0, "mismatches": 0, "errors": 0, "resumed": 0, "resumed_equal": 0}
        per_strategy: dict[str, dict] = {}
        sampled_none = {"compared": 0, "mismatches": 0}
        sampled_spec = {"compared": 0, "mismatches": 0}
        sampled_resumed = {"compared": 0, "mismatches": 0}
        diffs = []
        for rd in rounds:
            for res in rd["results"]:
                if res["error"]:
                    greedy["errors"] += 1
                    diffs.append({"round": rd["round"], "request": res["name"], "strategy": res["strategy"],
                                  "error": res["error"]})
                    continue
                if res["name"].startswith("sampled"):
                    ref = idle_sampled[(res["name"], res["strategy"])].choices[0]
                    # a resumed seeded request continues with a seed derived from the resume point (so
                    # it does not replay the draws that made its first tokens): the same distribution,
                    # not the idle tokens
                    into = (sampled_resumed if res["resumed"] else sampled_none if res["strategy"] == "none"
                            else sampled_spec)
                    into["compared"] += 1
                    if res["choices"][0] != ref:
                        into["mismatches"] += 1
                        diffs.append(_diff(rd["round"], res, 0, ref))
                    continue
                ref = idle[res["name"]].choices[0]
                st = per_strategy.setdefault(res["strategy"], {"compared": 0, "mismatches": 0})
                for ci, toks in enumerate(res["choices"]):
                    greedy["compared"] += 1
                    st["compared"] += 1
                    same = toks == ref
                    if res["resumed"]:
                        greedy["resumed"] += 1
                        greedy["resumed_equal"] += same
                    if not same:
                        greedy["mismatches"] += 1
                        st["mismatches"] += 1
                        diffs.append(_diff(rd["round"], res, ci, ref))
        ok = greedy["mismatches"] == 0 and greedy["errors"] == 0 and sampled_none["mismatches"] == 0
        return {"ok": ok, "config": {k: v for k, v in asdict(self.config).items() if k != "extra_env"},
                "cpu": cpu_model(), "seconds": round(seconds, 1), "rounds": len(rounds),
                "greedy": greedy, "per_strategy": per_strategy, "sampled_none": sampled_none,
                "sampled_speculative": sampled_spec, "sampled_resumed": sampled_resumed, "kills": self.kills,
                "idle_tokens": {n: r.choices[0] for n, r in idle.items()}, "differences": diffs[:50]}


def find_draft(model: str) -> str | None:
    """The target's distilled draft where `tandem distill` made one (the stack's own rule), else None."""
    from tandem.engine.model.paths import ModelError, find_default_draft, resolve_model_path

    try:
        found = find_default_draft(resolve_model_path(model)[0])
    except ModelError:
        return None
    return None if found is None else str(found)


def _diff(round_: int, res: dict, choice: int, ref: list[int]) -> dict:
    toks = res["choices"][choice]
    at = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
    return {"round": round_, "request": res["name"], "strategy": res["strategy"], "choice": choice,
            "resumed": res["resumed"], "first_difference": at, "got": toks[at:at + 8], "idle": ref[at:at + 8]}


def run_determinism(config: DeterminismConfig, on_event=None, out: Path | None = None) -> dict:
    report = Determinism(config, on_event).run()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    return report


def table(report: dict) -> list[tuple[str, str]]:
    g = report["greedy"]
    rows = [("CPU", report["cpu"]), ("rounds", str(report["rounds"])),
            ("greedy outputs compared", str(g["compared"])), ("greedy mismatches", str(g["mismatches"])),
            ("requests failed", str(g["errors"])),
            ("resumed after a kill (equal / all)", f"{g['resumed_equal']} / {g['resumed']}")]
    for strategy, st in sorted(report["per_strategy"].items()):
        rows.append((f"  {strategy}", f"{st['compared'] - st['mismatches']} / {st['compared']} equal"))
    for what, key in (("sampled, plain (must replay)", "sampled_none"),
                      ("sampled, speculative", "sampled_speculative"),
                      ("sampled, resumed after a kill (new seed)", "sampled_resumed")):
        s = report[key]
        if s["compared"]:
            rows.append((what, f"{s['compared'] - s['mismatches']} / {s['compared']} equal"))
    rows.append(("seconds", str(report["seconds"])))
    return rows
