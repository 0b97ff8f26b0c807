"""Side-by-side benchmark of decoding modes on one engine, as docs/design.md's "Measuring" asks.

Every prompt runs in every mode in this one process, interleaved: prompt 1 in ar, ngram, model;
prompt 2 in ngram, model, ar; ... The order rotates so that no mode always runs first (right after
another prompt's prefill, or a preemption that a neighbour's job caused), and a slow minute of a
shared machine hits all modes alike.

Two families of modes run on the same target, the same prompts and the same process:

    ours   ar (plain decoding: the baseline), ngram (prompt lookup), model (a draft model)
    peers  hf-ar (`transformers`' plain `generate`: the peers' baseline), hf-prompt-lookup
           (`generate(prompt_lookup_num_tokens=N)`), hf-assisted (`generate(assistant_model=draft)`);
           llamacpp (llama.cpp's plain decoding of the same GGUF file, its family's baseline) and
           llamacpp-lookup (its prompt-lookup decoding): tandem.tools.llamacpp

Speed is reported as ratios, medians over prompts, next to the acceptance figures that explain them:

    modes.M.speedup_vs_ar          median over prompts of (baseline s/token) / (M s/token), where the
                                   baseline is `modes.M.baseline`: ar for ours, hf-ar for the peers
    modes.M.tokens_per_s_vs_hf_ar  the same ratio against hf-ar for every mode (when hf-ar ran): the
                                   like-for-like comparison of ours with the peer
    modes.M.tokens_per_s_vs_llamacpp  likewise against llama.cpp's plain decoding (when it ran)
    modes.M.drafted_per_reply      drafted tokens per reply; under 3 the mode did not speculate
                                   (`modes.M.speculated` false) and its ratio is noise, not speculation
    modes.M.lossless               fraction of prompts whose output ids equal the baseline's (greedy)
    modes.M.agreement_with_ar      fraction of prompts whose output ids equal our ar's (greedy): for
                                   the peers, whether `transformers`' forward decodes the same text

A record with several user turns (MT-Bench) runs its first `turns` turns in order as one
conversation: turn t+1's context is the chat of the earlier turns with the mode's own replies. Our
modes keep one engine sequence per conversation, so a later turn reuses the KV of the earlier ones;
the peers call `generate` afresh each turn, as `transformers` is used (its prompt lookup does not
accept a pre-filled cache correctly in 5.x: its outputs then differ from plain decoding).

Prefix sharing (`share_prefix`, on unless a peer mode runs): a conversation of ours starts from a
copy of the KV that the conversations of the last PREFIX_DONORS earlier prompts hold of its first
prompt's longest common prefix, as a verifier copies a resident session's (a shared system prompt
or tool list is prefilled once, not once per session). Every mode of ours gets the same donors, the
earlier prompts' and never a sibling mode's run of the same prompt, and pays for the copy in its
time; the peers prefill every prompt whole, so with them in the run it is off by default and the
comparison stays like for like.

Each of our modes learns alone: its generations share acceptance counts with each other (as one
server's sessions do), never with another mode's. Shared, a mode read the others' evidence: the
hybrid run beside `suffix` learnt from suffix mode's long blocks what it never tried alone (measured
on agent_tools before the controller's positions inherited their priors: 1.33x beside suffix, 1.20x
alone), so a table compared modes that had helped each other. The cost curve stays shared: it is
the machine's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from rich import box
from rich.table import Table

from tandem.contract.params import DraftStrategy, SamplingParams
from tandem.contract.results import GenerationResult
from tandem.contract.results import FinishReason, SpecStats
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.native.build import cpu_model
from tandem.engine.native.progress import progress_bar
from tandem.engine.scheduler.generate import Engine
from tandem.engine.speculation.adaptive import AcceptanceCounts
from tandem.tools.datasets import PromptRecord, to_chat

MODES = {"ar": DraftStrategy.none, "ngram": DraftStrategy.ngram, "suffix": DraftStrategy.suffix,
         "model": DraftStrategy.model, "hybrid": DraftStrategy.hybrid,
         # the hybrid of prompt lookup and the draft model alone, as it was before suffix decoding joined it
         "hybrid-nosuffix": DraftStrategy.hybrid,
         # suffix decoding (alone, and in the hybrid) drafting chains only, no token trees
         "suffix-chain": DraftStrategy.suffix, "hybrid-chain": DraftStrategy.hybrid}
SUFFIX_MODES = ("suffix", "hybrid", "suffix-chain", "hybrid-chain")  # the modes that read a suffix store
HF_MODES = ("hf-ar", "hf-prompt-lookup", "hf-assisted")  # transformers' generate on the same model
LLAMACPP_MODES = ("llamacpp", "llamacpp-lookup")  # llama.cpp on the same GGUF file (tandem.tools.llamacpp)
PEER_MODES = (*HF_MODES, *LLAMACPP_MODES)
ALL_MODES = (*MODES, *PEER_MODES)
HF_LOOKUP_TOKENS = 10  # transformers' documented prompt_lookup_num_tokens
# How a record's functions (BFCL) reach the model: "prompt", as a tool list in its system message;
# "auto" / "required", as the API's tools with that tool_choice (rendered as the gateway renders them)
TOOL_MODES = ("prompt", "auto", "required")
WARMUP_TOKENS = 16  # enough steps to touch every code path (prefill, draft, verify, rollback) once
# Earlier prompts' conversations whose KV a new conversation may share (each holds ~46 KB a token in
# float32 for SmolLM2-135M: 4 of 1,500 tokens are ~280 MB). A multi-session workload's sessions share
# one prefix (agent_tools: the tool list), so the last few prompts always hold it.
PREFIX_DONORS = 4
LOSSLESS_NOTE = (
    "sampling with temperature > 0: outputs are equal to ar's in distribution, not token for token, "
    "so greedy equality does not apply"
)
NO_CATEGORY = "(none)"  # by_category's key for the records of a set that has categories but not on them


def baseline_of(mode: str) -> str:
    """The plain decoding a mode is compared with: our ar for ours, each peer's own plain decoding
    for the peers (hf-ar for transformers', llamacpp for llama.cpp's)."""
    return "hf-ar" if mode in HF_MODES else "llamacpp" if mode in LLAMACPP_MODES else "ar"


def seconds_per_token(seconds: float, tokens: int) -> float | None:
    """None when undefined (a generation that stopped before its first token)."""
    return seconds / tokens if tokens > 0 and seconds > 0 else None


def speedup_ratios(ar: Sequence[tuple[float, int]], mode: Sequence[tuple[float, int]]) -> list[float]:
    """Per-prompt speedups (ar seconds per token / mode seconds per token) from aligned per-prompt
    (seconds, tokens) pairs; prompts where either side produced no token are left out.

    Per-token times, not total times: under sampling the two modes may emit different lengths, and a
    mode must not look fast because it happened to stop early. Example: ar (2.0 s, 100 tokens) and
    ngram (1.0 s, 80 tokens) give 0.020 / 0.0125 = 1.6.
    """
    if len(ar) != len(mode):
        raise ValueError(f"{len(ar)} ar timings but {len(mode)} mode timings")
    out = []
    for (ar_s, ar_t), (m_s, m_t) in zip(ar, mode):
        a, m = seconds_per_token(ar_s, ar_t), seconds_per_token(m_s, m_t)
        if a is not None and m is not None:
            out.append(a / m)
    return out


def median_speedup(ar: Sequence[tuple[float, int]], mode: Sequence[tuple[float, int]]) -> float | None:
    """The median of `speedup_ratios`; None when no prompt has both timings."""
    ratios = speedup_ratios(ar, mode)
    return statistics.median(ratios) if ratios else None


def lossless_fraction(reference: Sequence[Sequence], runs: Sequence[Sequence[Sequence]]) -> float:
    """Fraction of prompts whose every run's output equals the reference's.

    reference[i]: the baseline's output of prompt i; runs[i]: the mode's output of each repeat of
    prompt i. An output is a list of ids, or for a conversation a list of them, one per turn. Any
    difference, a single token or a length, makes the prompt count as not lossless. Example:
    reference [[1, 2], [3]], runs [[[1, 2]], [[3, 4]]] gives 0.5.
    """
    if len(reference) != len(runs):
        raise ValueError(f"{len(reference)} reference outputs but {len(runs)} prompts of runs")
    if not reference:
        raise ValueError("no prompts to compare")
    equal = sum(all(list(r) == list(ref) for r in prompt_runs) for ref, prompt_runs in zip(reference, runs))
    return equal / len(reference)


def rotated(modes: Sequence[str], shift: int) -> list[str]:
    """`modes` started at position `shift`: rotated(["ar", "ngram", "model"], 1) = [ngram, model, ar]."""
    k = shift % len(modes)
    return list(modes[k:]) + list(modes[:k])


def median_run(runs: Sequence[GenerationResult]) -> GenerationResult:
    """The repeat of median time (the lower median for an even count): one real generation whose
    time, tokens and counts belong together, and a preempted repeat cannot skew it."""
    ordered = sorted(runs, key=lambda r: r.seconds)
    return ordered[(len(ordered) - 1) // 2]


def run_seed(seed: int, prompt_index: int, turn: int, turns: int) -> int:
    """The seed of one generation of a sampled run: its own per prompt and turn, the same in every
    mode, so the modes draw from equally seeded generators. Example: seed 7, 2 turns: prompt 0 turn 0
    gets 7, turn 1 gets 8, prompt 1 turn 0 gets 9."""
    return seed + prompt_index * turns + turn


def steps_by_accepted(stats: SpecStats) -> list[int] | None:
    """Histogram of target steps by the number of drafts they accepted: out[a] = steps that accepted
    exactly a drafts (committing a + 1 tokens), plain steps counted at a = 0.

    Drafts are accepted as a prefix, so accepted_by_position[i] counts the steps that accepted more
    than i drafts, and out[a] = accepted_by_position[a-1] - accepted_by_position[a]. Example: 10
    steps, accepted_by_position [6, 2] gives [4, 4, 2]. None when the per-position counts are not
    reported (a remote target sends only totals).
    """
    by_pos = stats.accepted_by_position
    if sum(by_pos) != stats.accepted:
        return None
    at_least = [stats.steps, *by_pos, 0]  # at_least[a] = steps that accepted >= a drafts
    return [at_least[a] - at_least[a + 1] for a in range(len(by_pos) + 1)]


# --- bench targets ----------------------------------------------------------------------------------
#
# A bench target has `model_id`, `draft_id`, `machine()` and `prepare(rec) -> (context, prompt
# tokens or None)`, and either `conversation(rec, mode)` (an object whose `turn(t, sampling)` runs
# user turn t and returns a GenerationResult) or `generate(context, sampling, mode)` for first turns
# only (tandem.tools.bench_remote.GatewayTarget). `modes` lists what it can run (default: ours).


class EngineTarget:
    """Bench target: an in-process Engine (the single-process reference loop), and `transformers`'
    own `generate` on the same model objects for the peer modes."""

    modes = ALL_MODES

    def __init__(self, engine: Engine, tokenizer, *, hf_lookup_tokens: int = HF_LOOKUP_TOKENS, tools: str = "prompt",
                 suffix_store=None, share_prefix: bool = False):
        if hf_lookup_tokens < 1:
            raise ValueError(f"hf_lookup_tokens must be >= 1, got {hf_lookup_tokens}")
        if tools not in TOOL_MODES:
            raise ValueError(f"tools must be one of {', '.join(TOOL_MODES)}, got {tools!r}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.hf_lookup_tokens = hf_lookup_tokens
        self.llamacpp = None  # tandem.tools.llamacpp.LlamaCppPeer, loaded when a llama.cpp mode runs
        self.tools = tools
        self.model_id = engine.target.model_id
        self.draft_id = engine.draft.model_id if engine.draft is not None else None
        # Suffix decoding's cross-session store (warm runs): run_bench holds what a prompt's runs
        # add until the prompt is done, so no prompt drafts from its own output. None: cold.
        self.suffix_store = suffix_store
        # Sequences of earlier prompts' conversations whose KV prefixes a first turn may copy
        # (run_bench donates one per prompt once all its modes ran); off: every first turn prefills whole
        self.share_prefix = share_prefix
        self.donors: collections.deque = collections.deque(maxlen=PREFIX_DONORS)
        self.acceptance: dict[str, AcceptanceCounts] = {}  # mode -> its own counts (module docstring)
        self._factories = {
            "suffix": dataclasses.replace(engine.factory, suffix_store=suffix_store),
            "hybrid": dataclasses.replace(engine.factory, suffix_store=suffix_store),
            "hybrid-nosuffix": dataclasses.replace(engine.factory, hybrid_suffix=False),
            "suffix-chain": dataclasses.replace(engine.factory, suffix_store=suffix_store, suffix_trees=False),
            "hybrid-chain": dataclasses.replace(engine.factory, suffix_store=suffix_store, suffix_trees=False),
        }

    def prepare(self, rec: PromptRecord) -> tuple[list[int], int]:
        ids = self.context_ids(rec, to_chat(rec, 0))
        return ids, len(ids)

    def context_ids(self, rec: PromptRecord, messages: list[dict]) -> list[int]:
        if self.tools != "prompt" and rec.functions:
            # the record's functions as the API's tools, rendered as the gateway renders them (the
            # template's tool support, or its Hermes-style convention), instead of its tool list text
            from tandem.services.gateway import tool_calls

            rest = messages[1:] if rec.system else messages
            head = [{"role": "system", "content": rec.system_without_tools}] if rec.system_without_tools else []
            ids = tool_calls.render(self.tokenizer, head + rest, rec.functions, apply_chat_template,
                                   tool_calls.detect(self.tokenizer))
        else:
            ids = apply_chat_template(self.tokenizer, messages)
        if len(ids) >= self.engine.target.max_context:
            raise ValueError(
                f"prompt {rec.id!r} of {rec.dataset} has {len(ids)} tokens and does not fit the "
                f"{self.engine.target.max_context}-token context window of {self.model_id}"
            )
        return ids

    def conversation(self, rec: PromptRecord, mode: str) -> "Conversation":
        return Conversation(self, rec, mode)

    def donate(self, conversation: "Conversation | None") -> None:
        """Offer a finished prompt's conversation KV to the first turns of later prompts."""
        if self.share_prefix and conversation is not None and conversation.sequence is not None:
            self.donors.append(conversation.sequence)

    def record_sampling(self, rec: PromptRecord, sampling: SamplingParams) -> SamplingParams:
        """With `tools="required"`, a record with functions is generated under the call grammar (one
        call object of its functions, as `tool_choice: required` at the gateway)."""
        if self.tools != "required" or not rec.functions:
            return sampling
        from tandem.services.gateway import tool_calls

        return sampling.model_copy(update={"grammar": tool_calls.call_grammar(
            rec.functions, tool_calls.detect(self.tokenizer).dialect)})

    def new_proposer(self, mode: str):
        """A proposer for one conversation in one of our modes (None: plain decoding)."""
        spec = self.engine.spec.model_copy(update={"strategy": MODES[mode]})
        return self._factories.get(mode, self.engine.factory).build(spec)

    def run(self, ids: list[int], sampling: SamplingParams, mode: str, sequence, proposer=None) -> GenerationResult:
        """One generation. `proposer`: the conversation's own, kept across its turns as its
        sequence is (a draft model's KV of the turns so far, prompt lookup's index); None: a new one."""
        if mode in MODES:
            spec = self.engine.spec.model_copy(update={"strategy": MODES[mode]})
            if proposer is None:
                proposer = self.new_proposer(mode)
            gen = self.engine.start(ids, sampling, spec, sequence=sequence, proposer=proposer,
                                    acceptance=self.acceptance.setdefault(mode, AcceptanceCounts()))
            for _ in gen:
                pass
            return gen.result()
        if mode in LLAMACPP_MODES:
            target = self.engine.target
            stop = sampling.stop_ids(target.eos_token_ids)
            return self.llamacpp_peer().generate(ids, sampling, stop, mode,
                                                 min(sampling.max_new_tokens, target.max_context - len(ids)))
        return self.hf_generate(ids, sampling, mode)

    def llamacpp_peer(self):
        if self.llamacpp is None:
            from tandem.tools.llamacpp import LlamaCppPeer

            self.llamacpp = LlamaCppPeer(self.engine.target.gguf_file, n_ctx=self.engine.target.max_context)
        return self.llamacpp

    def hf_generate(self, ids: list[int], sampling: SamplingParams, mode: str) -> GenerationResult:
        """One `transformers` `generate` call, timed like ours (wall time, prefill included), its
        output cut at the first stop token as ours is (the stop token is not output). `transformers`
        reports no speculation figures: the result's stats are None."""
        target = self.engine.target
        model = target.model
        stop = sampling.stop_ids(target.eos_token_ids)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        kwargs: dict = {
            "max_new_tokens": min(sampling.max_new_tokens, target.max_context - len(ids)),
            "eos_token_id": sorted(stop) or None,
            "pad_token_id": pad if pad is not None else min(stop, default=0),
        }
        if sampling.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        if mode == "hf-prompt-lookup":
            kwargs["prompt_lookup_num_tokens"] = self.hf_lookup_tokens
        elif mode == "hf-assisted":
            kwargs["assistant_model"] = self.engine.draft.model
        device = next(model.parameters()).device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, prompt]
        with _quiet_transformers():
            if not sampling.greedy and sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            start = time.perf_counter()
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)  # [1, prompt + new]
            seconds = time.perf_counter() - start
        tokens = out[0, len(ids):].tolist()
        stopped = next((i for i, t in enumerate(tokens) if t in stop), None)
        if stopped is not None:
            tokens = tokens[:stopped]
        return GenerationResult(
            token_ids=tokens,
            finish_reason=FinishReason.stop if stopped is not None else FinishReason.length,
            stats=None,
            prompt_tokens=len(ids),
            seconds=seconds,
            first_token_seconds=seconds,  # not observable inside one generate call
        )

    def machine(self) -> dict:
        return machine_info(self.engine)


class Conversation:
    """One record's turns in one mode, in order. Turn t's context is the chat of the earlier turns
    with this mode's own replies; our modes run every turn on one engine sequence (a later turn
    reuses the KV of the conversation so far), the peers start afresh each turn."""

    def __init__(self, target: EngineTarget, rec: PromptRecord, mode: str):
        self.target = target
        self.rec = rec
        self.mode = mode
        self.sequence = target.engine.runner.new_sequence() if mode in MODES else None
        # Kept across turns like the sequence, as the drafter keeps a session's (DrafterCore's
        # parked sessions): a later turn's draft model reads only the new tokens, not the whole
        # conversation again (a 1,400-token re-read per turn made the hybrid's second turns of
        # agent_tools slower than plain decoding)
        self.proposer = target.new_proposer(mode) if mode in MODES else None
        self.history: list[dict] | None = None  # earlier turns' messages, no system message

    def turn(self, t: int, sampling: SamplingParams) -> GenerationResult:
        messages = to_chat(self.rec, t, self.history if t > 0 else None)
        ids = self.target.context_ids(self.rec, messages)
        copy_s = 0.0
        if t == 0 and self.sequence is not None and self.target.share_prefix:
            start = time.perf_counter()
            self.sequence.share_longest(self.target.donors, ids)  # its length shows as prefill_reused_tokens
            copy_s = time.perf_counter() - start
        res = self.target.run(ids, self.target.record_sampling(self.rec, sampling), self.mode, self.sequence, self.proposer)
        if copy_s:  # the copy is part of this turn's prefill
            res = dataclasses.replace(res, seconds=res.seconds + copy_s,
                                      first_token_seconds=res.first_token_seconds + copy_s)
        reply = self.target.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        head = 1 if self.rec.system else 0
        self.history = messages[head:] + [{"role": "assistant", "content": reply}]
        return res


class _FirstTurnOnly:
    """A conversation over a target that only runs first turns (`generate(context, ...)`)."""

    def __init__(self, target, context, mode: str):
        self.target, self.context, self.mode = target, context, mode

    def turn(self, t: int, sampling: SamplingParams) -> GenerationResult:
        assert t == 0, "checked by run_bench"
        return self.target.generate(self.context, sampling, self.mode)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers warns about its own internal generation-config handling on assisted calls;
    that is noise in a benchmark's output."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


# --- the run ----------------------------------------------------------------------------------------


@dataclass
class _Figures:
    """One mode's figures on one unit of the summary: a prompt (its turns together) or one turn."""

    tokens: int
    seconds: float
    stats: SpecStats | None  # the turns' counts added up; None for a peer (transformers reports none)
    equal_to_ar: bool | None  # None when sampling
    equal_to_baseline: bool | None


def run_bench(
    engine,
    records: Sequence[PromptRecord],
    modes: list[str],
    max_new_tokens: int,
    *,
    tokenizer=None,
    sampling: SamplingParams | None = None,
    progress: bool = True,
    repeats: int = 1,
    turns: int = 1,
    hf_lookup_tokens: int = HF_LOOKUP_TOKENS,
    tools: str = "prompt",
    suffix_warm: bool = False,
    share_prefix: bool | None = None,
) -> dict:
    """Run the first `turns` turns of every record in every mode, interleaved; return the JSON-able
    report.

    `engine` is an in-process `Engine` (with `tokenizer`) or a bench target (see above; e.g.
    `tandem.tools.bench_remote.GatewayTarget`, our modes through a stack). `ar` is the baseline of our
    modes and `hf-ar` of the peers, so each runs whenever a mode of its family does. `sampling`
    defaults to greedy; its max_new_tokens is replaced by `max_new_tokens`; a sampled run without a
    seed gets seed 0, and every generation then its own seed (`run_seed`), the same in all modes
    (a seeded generation of ours picks block lengths from nominal costs so that it replays: see
    `tandem.engine.scheduler.generate.Generation`).
    With repeats > 1 each prompt runs that many times per mode and each turn's figures are those of
    its median-time repeat; equality with the baseline is required of every repeat.
    `suffix_warm`: suffix decoding's cross-session store (modes suffix and hybrid) is fed with the
    finished responses of the earlier prompts of this run; each prompt's own responses join it only
    after all its modes, repeats and turns ran. Off (cold): the store is empty, so those modes draft
    from the session's own tokens only.
    `share_prefix` (in process): our modes' first turns copy the KV of their longest common prefix
    with the last PREFIX_DONORS prompts' conversations (see the module docstring); None: on unless
    a peer mode runs.
    """
    store = None
    if suffix_warm:
        if not isinstance(engine, Engine):
            raise ValueError("suffix_warm runs in process: through a stack the drafters' stores warm themselves")
        from tandem.engine.speculation.suffix import SuffixStore

        store = SuffixStore()
    target = (
        EngineTarget(engine, tokenizer, hf_lookup_tokens=hf_lookup_tokens, tools=tools, suffix_store=store)
        if isinstance(engine, Engine) else engine
    )
    modes = _check_modes(target, modes)
    if isinstance(target, EngineTarget):
        target.share_prefix = (not any(m in PEER_MODES for m in modes)) if share_prefix is None else share_prefix
    elif share_prefix:
        raise ValueError("share_prefix runs in process: through a stack the verifiers share resident sessions' KV themselves")
    if any(m in LLAMACPP_MODES for m in modes):
        target.llamacpp_peer()  # loads the file now: a missing binding or a non-GGUF model fails before the run
    if tools != "prompt":
        if not isinstance(target, EngineTarget):
            raise ValueError("tools as API tools need an in-process engine; a remote target gets the record's tool list text")
        if tools == "required" and any(m in PEER_MODES for m in modes):
            raise ValueError("tools 'required' runs under a call grammar, which transformers' modes (hf-*) cannot; leave them out")
    if not records:
        raise ValueError("no prompts to benchmark")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    # in process every conversation is a session; through a stack only with a tenant per mode
    sessions = hasattr(target, "conversation") and getattr(target, "sessions", True)
    if turns > 1 and not sessions:
        raise ValueError("turns > 1 needs sessions: an in-process engine, or a stack with a tenant per mode "
                         "(mode_keys; `tandem bench --mode-tenants`); one-off remote requests run first turns only")
    sampling = (sampling or SamplingParams()).model_copy(update={"max_new_tokens": max_new_tokens})
    greedy = sampling.greedy
    if not greedy and sampling.seed is None:
        sampling = sampling.model_copy(update={"seed": 0})

    prepared = [target.prepare(rec) for rec in records]  # refuses a prompt too long before any timing
    n_turns = [min(turns, len(rec.turns)) for rec in records]

    def conversation(i: int, mode: str):
        if sessions:
            return target.conversation(records[i], mode)
        return _FirstTurnOnly(target, prepared[i][0], mode)

    def sampling_for(i: int, t: int) -> SamplingParams:
        return sampling if greedy else sampling.model_copy(update={"seed": run_seed(sampling.seed, i, t, turns)})

    # Untimed: the first forwards pay for allocation and kernel selection, and the draft model's
    # first forward for its own; one short generation per mode keeps that out of the first prompt.
    warmup = sampling_for(0, 0).model_copy(update={"max_new_tokens": min(max_new_tokens, WARMUP_TOKENS)})
    if store is not None:
        store.hold()
    for m in modes:
        # through a stack, a one-off request: a warm-up session would stay resident and hand prompt 0
        # its whole prefill (in process the warm-up's sequence is no donor)
        (conversation(0, m) if isinstance(target, EngineTarget) else _FirstTurnOnly(target, prepared[0][0], m)).turn(0, warmup)
    if store is not None:
        store.release(keep=False)  # the warm-up's partial answer of prompt 0 is not an earlier response

    # runs[i][m][r][t]: prompt i, mode m, repeat r, turn t
    runs: list[dict[str, list[list[GenerationResult]]]] = [{m: [] for m in modes} for _ in records]
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("bench", total=sum(n_turns) * len(modes) * repeats)
        for i in range(len(records)):
            if store is not None:
                store.hold()
            for r in range(repeats):
                convs = {m: conversation(i, m) for m in modes}
                outs: dict[str, list[GenerationResult]] = {m: [] for m in modes}
                for t in range(n_turns[i]):
                    for m in rotated(modes, (i * repeats + r) * turns + t):
                        outs[m].append(convs[m].turn(t, sampling_for(i, t)))
                        bar.advance(task)
                for m in modes:
                    runs[i][m].append(outs[m])
            if store is not None:
                store.release(keep=True)  # prompt i's answers serve the prompts after it
            if isinstance(target, EngineTarget):
                # one mode's conversation (they hold the same prompt KV): its prefix serves the prompts after it
                target.donate(next((convs[m] for m in modes if m in MODES), None))

    # chosen[i][m][t]: the median-time repeat of turn t
    chosen = [
        {m: [median_run([rep[t] for rep in runs[i][m]]) for t in range(n_turns[i])] for m in modes}
        for i in range(len(records))
    ]

    def equal(i: int, m: str, ref: str, t: int | None = None) -> bool | None:
        """Whether every repeat of mode m equals ref's first repeat on prompt i (turn t, or all)."""
        if not greedy or ref not in modes:
            return None

        def output(rep: list[GenerationResult]) -> list:
            return [g.token_ids for g in rep] if t is None else rep[t].token_ids

        return all(output(rep) == output(runs[i][ref][0]) for rep in runs[i][m])

    def figures(i: int, m: str, t: int | None = None) -> _Figures:
        results = chosen[i][m] if t is None else [chosen[i][m][t]]
        return _Figures(
            tokens=sum(len(g.token_ids) for g in results),
            seconds=sum(g.seconds for g in results),
            stats=None if m in PEER_MODES else _add_stats([g.stats for g in results]),
            equal_to_ar=equal(i, m, "ar", t),
            equal_to_baseline=equal(i, m, baseline_of(m), t),
        )

    per_prompt = [{m: figures(i, m) for m in modes} for i in range(len(records))]
    prompts = []
    for i, (rec, (_, prompt_tokens)) in enumerate(zip(records, prepared)):
        entry = {
            "id": rec.id, "dataset": rec.dataset, "category": rec.category, "prompt_tokens": prompt_tokens,
            "modes": {m: _prompt_figures(per_prompt[i][m]) for m in modes},
        }
        if turns > 1:
            entry["turns"] = [
                {
                    "turn": t + 1,
                    "modes": {
                        m: {
                            **_prompt_figures(figures(i, m, t)),
                            "prompt_tokens": chosen[i][m][t].prompt_tokens,
                            "prefill_reused_tokens": (
                                0 if m in PEER_MODES else chosen[i][m][t].stats.prefill_reused_tokens
                            ),
                        }
                        for m in modes
                    },
                }
                for t in range(n_turns[i])
            ]
        prompts.append(entry)

    result = {"modes": summarize(per_prompt, modes, greedy), "prompts": prompts}
    categories = [rec.category for rec in records]
    if any(c is not None for c in categories):
        groups: dict[str, list[int]] = {}
        for i, c in enumerate(categories):
            groups.setdefault(NO_CATEGORY if c is None else c, []).append(i)
        result["by_category"] = {c: summarize([per_prompt[i] for i in idx], modes, greedy) for c, idx in groups.items()}
    if turns > 1:
        result["by_turn"] = {
            str(t + 1): summarize([{m: figures(i, m, t) for m in modes} for i in range(len(records)) if n_turns[i] > t],
                                  modes, greedy)
            for t in range(max(n_turns))
        }
    result["config"] = {
        "model": target.model_id,
        "draft_model": target.draft_id,
        "max_new_tokens": max_new_tokens,
        "limit": len(records),
        "repeats": repeats,
        "turns": turns,
        "hf_lookup_tokens": hf_lookup_tokens if any(m in HF_MODES for m in modes) else None,
        "llamacpp": None if not any(m in LLAMACPP_MODES for m in modes) else {
            "llama_cpp_python": target.llamacpp.version, "threads": target.llamacpp.threads,
            "lookup_tokens": target.llamacpp.lookup_tokens, "gguf": target.engine.target.gguf_file},
        "machine": target.machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sampling": sampling.model_dump(mode="json"),
        "tools": tools,
        "prefix_sharing": (
            f"on: first turns copy the KV of their longest common prefix with the last {PREFIX_DONORS} earlier "
            "prompts' conversations (ours; the peers prefill whole)"
            if target.share_prefix else "off: every first turn prefills its whole prompt"
        ) if isinstance(target, EngineTarget) else (
            "the stack's verifiers': sessions, a tenant per mode, share KV with resident sessions of their tenant"
            if sessions else "off: one-off requests, never resident"),
        "suffix_store": None if not any(m in SUFFIX_MODES for m in modes) else (
            "warm: fed by the finished responses of earlier prompts of this run, never the measured prompt's own"
            if store is not None else "cold: empty, drafts from the session's own tokens only"
            if isinstance(target, EngineTarget) else
            "the stack's drafters' own: fed by every suffix or hybrid request they finished (here: earlier prompts)"),
    }
    if store is not None:
        result["config"]["suffix_store_end"] = {"responses": store.responses, "tokens": store.tokens}
    return result


# A speculative mode that drafted fewer tokens than this per reply did not speculate: whatever its
# ratio to plain decoding says is noise (or prefill and scheduling), never speculation's doing.
SPECULATED_MIN_DRAFTS_PER_REPLY = 3.0
DID_NOT_SPECULATE = "did not speculate"


def speculated(summary: dict) -> bool | None:
    """Whether a mode's summary shows speculation (None for modes that never draft: ar, peers)."""
    per_reply = summary.get("drafted_per_reply")
    return None if per_reply is None else per_reply >= SPECULATED_MIN_DRAFTS_PER_REPLY


def speedup_cell(summary: dict) -> str:
    """A mode's speedup as the tables print it, marked when the mode drafted (almost) nothing."""
    cell = _fmt(summary.get("speedup_vs_ar"), "{:.2f}x")
    return cell + f" ({DID_NOT_SPECULATE})" if speculated(summary) is False else cell


def summarize(units: Sequence[dict[str, _Figures]], modes: Sequence[str], greedy: bool) -> dict:
    """Per-mode summary over units (prompts, or one turn of each prompt): totals, median ratios,
    acceptance, the lossless fractions."""
    summary = {}
    timing = {m: [(u[m].seconds, u[m].tokens) for u in units] for m in modes}
    for m in modes:
        tokens = sum(u[m].tokens for u in units)
        seconds = sum(u[m].seconds for u in units)
        base = baseline_of(m)
        s = {
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "baseline": base,
            "speedup_vs_ar": median_speedup(timing[base], timing[m]),
            "tokens_per_s_vs_hf_ar": median_speedup(timing["hf-ar"], timing[m]) if "hf-ar" in modes else None,
            "tokens_per_s_vs_llamacpp": median_speedup(timing["llamacpp"], timing[m]) if "llamacpp" in modes else None,
            "acceptance_rate": None,
            "mean_accepted_len": None,
            "drafted_by_position": None,
            "accepted_by_position": None,
            "steps_by_accepted": None,
            "lossless": _fraction([u[m].equal_to_baseline for u in units]) if greedy else None,
            "agreement_with_ar": _fraction([u[m].equal_to_ar for u in units]) if greedy and "ar" in modes else None,
        }
        if m not in PEER_MODES:
            st = _add_stats([u[m].stats for u in units])
            s["acceptance_rate"] = st.accepted / st.drafted if st.drafted else None  # None: nothing drafted
            if m != "ar":
                s["drafted"] = st.drafted
                s["drafted_per_reply"] = st.drafted / len(units) if units else 0.0
                s["speculated"] = speculated(s)
            s["mean_accepted_len"] = (st.accepted + st.steps) / st.steps if st.steps else None
            s["drafted_by_position"] = st.drafted_by_position
            s["accepted_by_position"] = st.accepted_by_position
            s["steps_by_accepted"] = steps_by_accepted(st)
            if m in SUFFIX_MODES:  # token trees: steps that verified one, and those it paid off on
                s["steps"], s["tree_steps"], s["tree_off_path"] = st.steps, st.tree_steps, st.tree_off_path
            # which proposer drafted how often, and how well (a hybrid's choice and its outcome)
            s["by_proposer"] = {
                name: {**c, "acceptance_rate": c["accepted"] / c["drafted"] if c["drafted"] else None}
                for name, c in sorted(st.by_proposer.items())
            }
        if not greedy:
            s["lossless_note"] = LOSSLESS_NOTE
        summary[m] = s
    return summary


def _fraction(flags: Sequence[bool | None]) -> float | None:
    return sum(bool(f) for f in flags) / len(flags) if flags else None


def _add_stats(stats: Sequence[SpecStats]) -> SpecStats:
    """The counts of several generations added up (the by-position lists element by element)."""
    total = SpecStats()
    for st in stats:
        total.drafted += st.drafted
        total.accepted += st.accepted
        total.steps += st.steps
        total.tree_steps += st.tree_steps
        total.tree_off_path += st.tree_off_path
        for name in ("drafted_by_position", "accepted_by_position"):
            acc, add = getattr(total, name), getattr(st, name)
            acc.extend([0] * (len(add) - len(acc)))
            for k, v in enumerate(add):
                acc[k] += v
        for name, counts in st.by_proposer.items():
            mine = total.by_proposer.setdefault(name, {"steps": 0, "drafted": 0, "accepted": 0})
            for key, v in counts.items():
                mine[key] += v
    return total


def _prompt_figures(f: _Figures) -> dict:
    st = f.stats
    return {
        "tokens": f.tokens,
        "seconds": f.seconds,
        "tokens_per_s": f.tokens / f.seconds if f.seconds > 0 else 0.0,
        "drafted": st.drafted if st else None,
        "accepted": st.accepted if st else None,
        "steps": st.steps if st else None,
        "mean_accepted_len": st.mean_accepted_len if st else None,
        "equal_to_ar": f.equal_to_ar,
        "equal_to_baseline": f.equal_to_baseline,
    }


def machine_info(engine: Engine) -> dict:
    device = next(engine.target.model.parameters()).device
    info = {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    plan = getattr(getattr(engine.runner.backend, "impl", None), "gemm_plan", None)
    if plan is not None:
        from tandem.engine.model.gemm import INVARIANT, GemmSettings

        # the setting ("invariant", "auto" or a forced path) and the path(s) it gave: "auto" (measured
        # on this machine) or the one path every call takes
        info["gemm"] = GemmSettings.mode if GemmSettings.mode == INVARIANT else plan.mode
        info["gemm_plan"] = plan.mode
    return info


def format_table(result: dict) -> Table:
    """The per-mode summary of a `run_bench` result, for the terminal."""
    cfg = result["config"]
    peers = any(s.get("tokens_per_s_vs_hf_ar") is not None for s in result["modes"].values())
    table = Table(
        title=f"{cfg['model']}: {cfg['limit']} prompts, {cfg['max_new_tokens']} new tokens",
        caption=(
            "speedup: median over prompts of the baseline's time per token / the mode's, run side by side "
            "(baseline: ar for ours, hf-ar for transformers'); drafts: drafted tokens per reply "
            f"(under {SPECULATED_MIN_DRAFTS_PER_REPLY:g}: {DID_NOT_SPECULATE}, the ratio is noise); "
            "accept: drafts accepted; tok/step: tokens committed per target forward"
        ),
    )
    # Short headers kept whole, no vertical rules, long mode names folded: the table reads in 80
    # columns. A mode that did not speculate says so under its name, on its ratio's row.
    table.box, table.pad_edge = box.SIMPLE_HEAD, False
    cols = ["mode", "tok/s", "speedup", *(["vs hf-ar"] if peers else []), "drafts", "accept", "tok/step",
            "lossless"]
    for col in cols:
        table.add_column(col, justify="left" if col == "mode" else "right", overflow="fold",
                         min_width=max(len(col), 10 if col == "mode" else 0))
    for mode, s in result["modes"].items():
        table.add_row(
            mode + (f"\n({DID_NOT_SPECULATE})" if speculated(s) is False else ""),
            _fmt(s["tokens_per_s"], "{:.1f}"),
            _fmt(s.get("speedup_vs_ar"), "{:.2f}x"),
            *([_fmt(s.get("tokens_per_s_vs_hf_ar"), "{:.2f}x")] if peers else []),
            _fmt(s.get("drafted_per_reply"), "{:.1f}"),
            _fmt(s["acceptance_rate"], "{:.1%}"),
            _fmt(s["mean_accepted_len"], "{:.2f}"),
            # a count, not a rounded percentage: 199 of 200 equal outputs must not print as 100%
            "-" if s["lossless"] is None else f"{round(s['lossless'] * cfg['limit'])}/{cfg['limit']}",
        )
    if peers:
        table.caption += "; vs hf-ar: median ratio of tokens/s to transformers' plain generate"
    notes = {s["lossless_note"] for s in result["modes"].values() if s.get("lossless_note")}
    if notes:
        table.caption += "\nlossless: " + "; ".join(sorted(notes))
    return table


def format_category_table(result: dict) -> Table | None:
    """Speedup per category (rows) and mode (columns), or None when the prompts have fewer than two
    categories."""
    by_cat = result.get("by_category")
    if not by_cat or len(by_cat) < 2:  # one category is the whole set: the main table says it
        return None
    modes = [m for m in result["modes"] if m not in ("ar", "hf-ar")]
    table = Table(
        title="speedup by category",
        caption="median speedup over the category's prompts against the mode's baseline (ar, or hf-ar for "
        "transformers' modes); acceptance in parentheses",
    )
    table.add_column("category", overflow="fold")
    table.add_column("prompts", justify="right", overflow="fold")
    for m in modes:
        table.add_column(m, justify="right", overflow="fold")
    counts: dict[str, int] = {}
    for p in result["prompts"]:
        key = NO_CATEGORY if p["category"] is None else p["category"]
        counts[key] = counts.get(key, 0) + 1
    for cat, summary in by_cat.items():
        cells = []
        for m in modes:
            s = summary[m]
            acc = s["acceptance_rate"]
            cells.append(speedup_cell(s) + ("" if acc is None else f" ({acc:.0%})"))
        table.add_row(cat, str(counts.get(cat, 0)), *cells)
    return table


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _check_modes(target, modes: Sequence[str]) -> list[str]:
    supported = getattr(target, "modes", tuple(MODES))
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(map(repr, unknown))}; choose from {', '.join(ALL_MODES)}")
    unsupported = [m for m in modes if m not in supported]
    if unsupported:
        raise ValueError(
            f"mode(s) {', '.join(map(repr, unsupported))} run in process only (peers: transformers' generate or "
            f"llama.cpp on the same model); this target runs {', '.join(supported)}"
        )
    if len(set(modes)) != len(modes):
        raise ValueError(f"modes repeat: {list(modes)}")
    for m in ("model", "hybrid", "hybrid-nosuffix", "hybrid-chain", "hf-assisted"):
        if m in modes and target.draft_id is None:
            raise ValueError(f"mode {m!r} needs a draft model (--draft-model PATH)")
    out = list(modes)
    # each family's baseline runs whenever a mode of the family does, first among its family
    if any(m in HF_MODES for m in out) and "hf-ar" not in out:
        out.insert(next(i for i, m in enumerate(out) if m in HF_MODES), "hf-ar")
    if any(m in LLAMACPP_MODES for m in out) and "llamacpp" not in out:
        out.insert(next(i for i, m in enumerate(out) if m in LLAMACPP_MODES), "llamacpp")
    if any(m in MODES for m in out) and "ar" not in out:
        out.insert(0, "ar")
    return out
