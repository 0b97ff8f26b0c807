"""The speculative decoding loop, in one process. It documents the algorithm and is the oracle that
the distributed system's tests compare against.

    prefill(context)                       # KV for context[:-1], reusing any resident prefix
    while not finished:
        k     = controller.choose(...)     # 0 = plain decoding step
        draft = proposer.propose(ids, k)   # at most k tokens after ids
        logits = target.forward([ids[-1]] + draft)          # [k+1, vocab], one forward
        tokens = verify(logits, draft)     # accepted drafts + one recovered/bonus token
                                           # (served: every session's rows in one kernel call)
        commit(tokens); emit(tokens)       # KV of rejected drafts is dropped

Each committed token is emitted once, in order, and the output equals plain decoding's: token for
token when greedy, in distribution when sampling.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator

import torch

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.contract.results import FinishReason, GenerationResult, SpecStats, StepOutput, TokenLogprob
from tandem.engine.model.loading import LoadedModel
from tandem.engine.scheduler.batching import PlannedStep
from tandem.engine.scheduler.runner import PrefillStats, Sequence, TargetRunner
from tandem.engine.speculation.adaptive import AcceptanceCounts, BlockLengthController
from tandem.engine.speculation.draft import Draft, Proposer
from tandem.engine.speculation.proposers import ProposerFactory
from tandem.engine.speculation.sampling import make_generator
from tandem.engine.speculation.verify import Check


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Row i of `logits # [n, vocab]` (the raw target logits at the position of tokens[i]) as the
    token's log-probability and the `top` most probable alternatives."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits[: len(tokens)].float(), -1)  # [n, vocab]
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device).unsqueeze(-1)).squeeze(-1).tolist()
    alts = lp.topk(top, -1) if top else None
    out = []
    for i, tok in enumerate(tokens):
        alt = () if alts is None else tuple(zip(alts.indices[i].tolist(), alts.values[i].tolist()))
        out.append(TokenLogprob(tok, chosen[i], alt))
    return out


class StopStrings:
    """Finds the token whose text completes a stop string: tokens are pushed one by one, their text
    is decoded incrementally, and only the last (longest stop - 1) characters are kept besides the
    new text, which is all a match completing now can span."""

    def __init__(self, stops: tuple[str, ...], tokenizer):
        from tandem.contract.text import Detokenizer

        self.stops = stops
        self._keep = max(len(s) for s in stops) - 1
        self._detok = Detokenizer(tokenizer)
        self._tail = ""

    def push(self, token: int) -> bool:
        text = self._tail + self._detok.push([token])
        hit = any(s in text for s in self.stops)
        self._tail = text[-self._keep:] if self._keep else ""
        return hit


def trees_allowed(runner: TargetRunner, sampling: SamplingParams) -> bool:
    """Whether a generation with `sampling` verifies token trees on `runner`: where the target
    runs them and nothing needs the drafts position by position (penalties, logit bias, a grammar,
    logprobs). Elsewhere a tree proposer drafts chains."""
    return (runner.trees_ok and sampling.grammar is None and not sampling.adjusts_logits
            and sampling.top_logprobs is None)


class Generation:
    """The decode loop of one request on one sequence. Iterate to run it step by step."""

    def __init__(
        self,
        runner: TargetRunner,
        sequence: Sequence,
        context_ids: list[int],
        sampling: SamplingParams,
        spec: SpecConfig,
        proposer: Proposer | None,
        *,
        shared_acceptance: AcceptanceCounts,
        eos_token_ids: list[int],
        resumed: int = 0,
    ):
        """`resumed`: the last `resumed` context tokens are this generation's own output so far,
        produced before a failover (SessionGenerateRequest.resumed_tokens); they count as generated
        for the penalties, the grammar and the stop strings, so the continuation is the one an
        uninterrupted generation would have made."""
        if not 0 <= resumed < len(context_ids):
            raise ValueError(f"resumed_tokens must be 0 to {len(context_ids) - 1} (the context's length - 1), "
                             f"got {resumed}")
        if len(context_ids) >= runner.loaded.max_context:
            raise ValueError(
                f"prompt of {len(context_ids)} tokens does not fit the context window of "
                f"{runner.loaded.max_context} tokens"
            )
        self.runner = runner
        self.seq = sequence
        self.sampling = sampling
        self.spec = spec
        self.proposer = proposer
        self.prompt_len = len(context_ids) - resumed  # where this request's output begins
        self._context_len = len(context_ids)
        self._stop_id: int | None = None  # the stop id that ended the output, if one did
        if proposer is not None:
            proposer.begin(self.prompt_len)
        self.gen = None if sampling.greedy else make_generator(sampling.seed)
        self.stop_ids = sampling.stop_ids(eos_token_ids)
        # Stop strings are matched on the output's text as each token is committed, in order, so the
        # token that completes one is the same with speculation as without.
        self._stop_text = StopStrings(sampling.stop, runner.loaded.tokenizer) if sampling.stop else None
        self.constraint = None
        self.error: str | None = None  # why the generation ended with FinishReason.error
        if sampling.grammar is not None:
            from tandem.engine.speculation.grammar import Constraint

            self.constraint = Constraint(sampling.grammar, runner.loaded.tokenizer, runner.loaded.vocab_size,
                                         sorted(self.stop_ids))
        earlier = list(context_ids[self.prompt_len:])  # output streamed before a failover
        if earlier and self.constraint is not None:
            try:
                self.constraint.advance(earlier)
            except RuntimeError:
                raise ValueError("the resumed tokens do not follow the request's grammar") from None
        hit = False
        if earlier and self._stop_text is not None:
            for tok in earlier:
                hit = self._stop_text.push(tok)
        if earlier and (hit or earlier[-1] in self.stop_ids):
            # The interrupted generation had ended; only its final message was lost.
            self.finish_reason = FinishReason.stop
        # A seeded sampled request must replay exactly, and its random draws follow its block lengths,
        # so those may depend only on its own text: nominal costs, no measured draft time, and
        # acceptance counted for this request alone (other sessions' counts change between replays).
        self.replayable = not sampling.greedy and sampling.seed is not None
        self.controller = BlockLengthController(
            spec.max_draft_tokens,
            runner.nominal_costs if self.replayable else runner.costs,
            AcceptanceCounts() if self.replayable else shared_acceptance,
            adaptive=spec.adaptive,
        )
        self.trees = trees_allowed(runner, sampling)
        if proposer is not None:
            proposer.allow_trees(self.trees)
        self.stats = SpecStats()
        self._last_step = (-1, 0, 0)  # see finish_step
        self.output: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.started = time.perf_counter()
        self.first_token_at: float | None = None
        prefill: PrefillStats = self.seq.set_context(list(context_ids))
        self.stats.prefill_reused_tokens = prefill.reused
        self.stats.prefill_computed_tokens = prefill.computed
        self.prefill_copied = prefill.copied  # of reused: copied from a prompt prefilled beside it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _draft(self) -> tuple[Draft | None, int]:
        """This step's drafts (None: a plain step) and the block length the controller asked for."""
        if self.proposer is None:
            return None, 0
        ids = self.seq.ids
        room = min(
            self.sampling.max_new_tokens - len(self.output) - 1,  # drafts past the limit are waste
            self.runner.loaded.max_context - len(ids) - 1,
        )
        batch_tokens, batch_committed = self._batch_load()
        # Every offer (one, or one per inner proposer of a hybrid) is valued by the committed tokens
        # per second it is expected to buy; the best drafts. None worth drafting: a plain step.
        ctl = self.controller
        # (offer, k, expected, cost) of the best choice so far; plain decoding to start with
        best = (None, 0, *ctl.plain(batch_tokens, batch_committed))

        declined_offers = []  # offers whose best block length was 0 (probe candidates)

        def consider(offer) -> None:
            nonlocal best
            k, expected, cost = ctl.plan_detail(offer.proposer, offer.bucket, min(room, offer.available),
                                                batch_tokens, batch_committed, offer.tree)
            if k > 0 and (best[3] <= 0 or expected / cost > best[2] / best[3]):
                best = (offer, k, expected, cost)
            elif k <= 0:
                declined_offers.append(offer)

        costly_looks = []
        for offer in self.proposer.offers(ids):
            if offer.available <= 0:
                continue  # e.g. prompt lookup found no match: nothing to draft, no drafting cost
            if offer.needs_peek:
                costly_looks.append(offer)
            else:
                consider(offer)
        for offer in costly_looks:
            # A draft model's confidence costs its first step to learn: look only where the
            # buckets it has found so far make the look pay against the best choice without it.
            if ctl.worth_peeking(offer.proposer, min(room, offer.available), (best[2], best[3]),
                                 batch_tokens, batch_committed):
                offer = self.proposer.rate(offer.proposer, ids)
                ctl.note_bucket(offer.proposer, offer.bucket)
                if offer.available > 0:
                    consider(offer)
        offer, k = best[0], best[1]
        if (offer is None or k <= 0) and batch_committed == 0:
            # Nothing pays by the current estimates. Those only change with evidence, so now and
            # then test a declined offer with a few drafts (adaptive.py: probes); not under batching,
            # where a probe would also slow the other sessions' step.
            for declined in declined_offers:
                probe = ctl.probe(declined.proposer, declined.bucket, min(room, declined.available), declined.tree)
                if probe:
                    offer, k = declined, probe
                    break
        if offer is None or k <= 0:
            return None, 0
        draft = self.proposer.propose_from(offer.proposer, ids, k, self.sampling, self.gen)
        self.stats.draft_seconds += draft.seconds
        if self.proposer.costly and not self.replayable:
            # Per drafted token, without one-off catch-ups (a draft model reading the prompt): that
            # time is not what the next drafts will cost. Unknown (only a catch-up ran): no sample.
            per_token = self.proposer.per_token_seconds()
            if per_token is not None:
                self.controller.observe_draft_cost(draft.proposer, 1, per_token)
        return (draft if len(draft) else None), k

    def _batch_load(self) -> tuple[int, float]:
        """What other sessions add to the next batched forward: (tokens, committed tokens), from the
        step loop's last step less this generation's own part of it. Zero when not batching, and
        for replayable requests (timing-independent). The others' committed tokens are what they
        did commit, not one each: sessions that draft well commit several, and a draft of ours
        must pay against that whole batch's output, or blocks get priced too cheaply in big batches."""
        ex = self.runner.executor
        if ex is None or self.replayable:
            return 0, 0.0
        rows, tokens, committed = ex.last_rows
        if self._last_step[0] == ex.steps_planned:  # we were in that step: leave ourselves out
            rows, tokens, committed = rows - 1, tokens - self._last_step[1], committed - self._last_step[2]
        if rows <= 0:
            return 0, 0.0
        return tokens, float(committed)

    def step(self) -> StepOutput:
        """Run one target forward; return what it committed (`plan_step`, the forward,
        `finish_step`: the verifier's step loop runs the three parts itself, batched)."""
        planned = self.plan_step()
        if not isinstance(planned, PlannedStep):
            return planned
        raw = self.runner.forward(planned.cache, planned.inputs, alone=planned.alone, tree=planned.tree,
                                  check=planned.check)
        return self.finish_step(planned, raw)

    def plan_step(self) -> PlannedStep | StepOutput:
        """The next step's forward: drafts, block and verification (a StepOutput instead when the
        generation ends without one: a grammar with no way on)."""
        if self.finished:
            raise RuntimeError("generation already finished")
        draft, block_len = self._draft()
        start = time.perf_counter()
        bitmask = None
        if self.constraint is not None:
            # The block is cut right after the first draft the grammar refuses; every position's
            # mask is filled now, from the committed state and the drafts before it.
            draft, bitmask = self.constraint.prepare(draft)
            if self.constraint.dead_end(bitmask):
                self.finish_reason = FinishReason.error
                self.error = "no token of this model's vocabulary can continue the grammar"
                return StepOutput(tokens=[], first_index=len(self.output), drafted=0, accepted=0)
        tree = draft is not None and draft.is_tree
        # The verification travels with the forward: in the verifier's step loop every session's
        # rows of a step are verified together (tandem.engine.speculation.verify.verify_rows).
        check = Check(draft, self.sampling, self.gen)
        if self.constraint is not None:
            check.mask = functools.partial(self.constraint.mask, bitmask=bitmask)
        if self.sampling.adjusts_logits and not tree:
            ids = self.seq.ids
            check.prompt_ids, check.generated_ids = ids[: self.prompt_len], ids[self.prompt_len:]
        tokens = draft.tokens if draft is not None else []
        return PlannedStep(
            cache=self.seq.cache,
            inputs=self.seq.block_inputs(tokens),
            check=check,
            # With logprobs, every row is computed as a one-token step would (where the backend
            # can): the numbers are then plain decoding's to the bit, not only within rounding.
            alone=not tree and self.sampling.top_logprobs is not None and self.runner.backend.rows_alone,
            tree=self.seq.tree_rows(draft.parents) if tree else None,  # logits row i+1 after node i
            state=(draft, block_len, start),
        )

    def finish_step(self, planned: PlannedStep, raw: torch.Tensor) -> StepOutput:
        """Commit what the planned step's verification decided (`raw`: its logits `# [k+1, vocab]`)."""
        draft, block_len, start = planned.state
        tree = planned.tree is not None
        verdict = planned.check.result()
        self.stats.verify_seconds += time.perf_counter() - start
        ex = self.runner.executor
        # (the loop's step this was, its tokens, its committed tokens): see _batch_load
        self._last_step = ((ex.steps_planned + 1) if ex is not None else 0, len(planned.inputs), len(verdict.tokens))
        if draft is not None:
            # a tree planned as such is counted as one even when it came out a single branch
            nodes = None if draft.parents is None else verdict.nodes if tree else list(range(verdict.accepted))
            self.controller.observe(draft.proposer, draft.bucket, len(draft), verdict.accepted, nodes)
        if tree:
            self.seq.commit_tree(verdict.tokens, verdict.nodes)
        else:
            self.seq.commit(verdict.tokens)
        if self.constraint is not None:
            self.constraint.advance(verdict.tokens)
        self.stats.record(verdict.drafted, verdict.accepted, draft.proposer if draft is not None else None,
                          draft.depth() if tree else None)
        if tree:
            self.stats.tree_steps += 1
            first = draft.as_chain().tokens
            self.stats.tree_off_path += verdict.tokens[: verdict.accepted] != first[: verdict.accepted]
        out = self._emit(verdict.tokens, verdict.drafted, verdict.accepted)
        if self.finish_reason in (FinishReason.stop, FinishReason.length):
            # A block may have committed tokens past the end (drafts accepted after a stop id, or past
            # the token limit): nobody's answer. Drop them, so the sequence ends as plain decoding
            # leaves it: the output (and the stop id, pending) with the KV of everything before. A
            # later turn reuses that KV and prefills the rest, and the prefill computes positions with
            # other kernels than a decode step does (torch's attention over a long piece), so which
            # positions were decoded must not depend on the mode, or the next turn's numbers differ.
            self.seq.truncate(self._context_len + len(self.output) + (self._stop_id is not None))
        if self.sampling.top_logprobs is not None:
            out.logprobs = token_logprobs(raw[: len(out.tokens)], out.tokens, self.sampling.top_logprobs)
        out.proposer = draft.proposer if draft is not None else None
        out.block_len = block_len
        if self.proposer is not None:
            out.faults = (self.proposer.fallback_steps, self.proposer.rejected_blocks)
            if self.finished:
                if self.finish_reason != FinishReason.error:
                    # The text as it ended: context, output, and the stop id that ended it (the
                    # sequence was cut there above)
                    self.proposer.finish(list(self.seq.ids))
                self.proposer.close()
            else:
                self.proposer.on_commit(self.seq.ids, verdict.tokens, self._next_block_hint())
        return out

    def _next_block_hint(self) -> int:
        """Drafts to ask a remote drafter for: cheap proposers may send up to the maximum (the
        controller truncates per step); a costly one only as many as currently pay."""
        if not self.spec.adaptive:
            return self.spec.max_draft_tokens
        if self.proposer.costly or self.spec.strategy in (DraftStrategy.model, DraftStrategy.hybrid):
            return max(1, self.controller.choose(self.spec.strategy.value, 0, self.spec.max_draft_tokens))
        # A cheap proposer (suffix decoding; prompt lookup runs on the verifier): up to the maximum.
        return self.spec.max_draft_tokens

    def _emit(self, tokens: list[int], drafted: int, accepted: int) -> StepOutput:
        first_index = len(self.output)
        out: list[int] = []
        for tok in tokens:
            if tok in self.stop_ids:
                self.finish_reason = FinishReason.stop
                self._stop_id = tok
                break
            out.append(tok)
            if self._stop_text is not None and self._stop_text.push(tok):
                self.finish_reason = FinishReason.stop
                break
            if len(self.output) + len(out) >= self.sampling.max_new_tokens:
                self.finish_reason = FinishReason.length
                break
        if self.finish_reason is None and len(self.seq.ids) >= self.runner.loaded.max_context:
            self.finish_reason = FinishReason.length
        self.output.extend(out)
        if out and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        return StepOutput(tokens=out, first_index=first_index, drafted=drafted, accepted=accepted)

    def cancel(self) -> None:
        if not self.finished:
            self.finish_reason = FinishReason.cancelled
            if self.proposer is not None:
                self.proposer.close()

    def __iter__(self) -> Iterator[StepOutput]:
        while not self.finished:
            yield self.step()

    def result(self) -> GenerationResult:
        end = time.perf_counter()
        if self.proposer is not None:
            self.stats.fallback_steps = self.proposer.fallback_steps
            self.stats.rejected_blocks = self.proposer.rejected_blocks
        first = (self.first_token_at or end) - self.started
        self.stats.prefill_seconds, self.stats.decode_seconds = first, end - self.started - first
        return GenerationResult(
            token_ids=list(self.output),
            finish_reason=self.finish_reason or FinishReason.cancelled,
            stats=self.stats,
            prompt_tokens=self.prompt_len,
            seconds=end - self.started,
            first_token_seconds=first,
        )


class Engine:
    """A target (and optionally a draft model) in one process: what `tandem generate` and
    `tandem bench` run, and the reference for the distributed services."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, spec: SpecConfig | None = None, *,
                 draft_int8: bool = True):
        self.target = target
        self.draft = draft
        self.runner = TargetRunner(target)
        self.spec = spec or SpecConfig()
        self.factory = ProposerFactory(self.spec, draft_model=draft, target_vocab=target.vocab_size,
                                       draft_int8=draft_int8)
        self.acceptance = AcceptanceCounts()

    def start(
        self,
        context_ids: list[int],
        sampling: SamplingParams,
        spec: SpecConfig | None = None,
        *,
        sequence: Sequence | None = None,
        proposer: Proposer | None = None,
        resumed: int = 0,
        acceptance: AcceptanceCounts | None = None,
    ) -> Generation:
        """`acceptance`: the runner-wide acceptance counts this generation learns from and adds to
        (default: the engine's own, shared by every generation)."""
        spec = spec or self.spec
        if proposer is None and spec.strategy != DraftStrategy.none:
            proposer = self.factory.build(spec)
        return Generation(
            self.runner,
            sequence if sequence is not None else self.runner.new_sequence(),
            context_ids,
            sampling,
            spec,
            proposer,
            shared_acceptance=self.acceptance if acceptance is None else acceptance,
            eos_token_ids=self.target.eos_token_ids,
            resumed=resumed,
        )

    def generate(
        self,
        context_ids: list[int],
        sampling: SamplingParams,
        spec: SpecConfig | None = None,
        *,
        on_step: Callable[[StepOutput], None] | None = None,
    ) -> GenerationResult:
        gen = self.start(context_ids, sampling, spec)
        for step in gen:
            if on_step is not None:
                on_step(step)
        return gen.result()


