"""The one place where domain objects meet `tandem.v1` protobuf messages.

Servicers and gRPC clients call these functions; the domain cores never see a message. Each pair
is exact both ways for what the contract carries (a proto3 zero means "not set" where the proto
comment says so: `top_p` 0 = off, `max_new_tokens` 0 = server default, strategy UNSPECIFIED =
server default). Where a message comes from a peer, a value this build cannot honour (out of
range, an enum number it does not know) raises ValueError with a message for the caller: the
servicers turn it into INVALID_ARGUMENT.
"""

from __future__ import annotations

import time

from pydantic import ValidationError

from tandem.contract.params import DraftStrategy, Grammar, SamplingParams, SpecConfig
from tandem.contract.results import FinishReason, SpecStats, TokenLogprob
from tandem.contract.results import GenerationResult, StepOutput
from tandem.serving.messages import (
    CommittedTokens,
    DraftBlock,
    DrafterInfo,
    DraftSessionOpen,
    VerifierRequest,
)
from tandem.serving.residency import VerifierRecord
from tandem.v1 import common_pb2, drafter_pb2, verifier_pb2

# -- enums --------------------------------------------------------------------------------------

STRATEGY_TO_PB = {
    DraftStrategy.none: common_pb2.DRAFT_STRATEGY_NONE,
    DraftStrategy.ngram: common_pb2.DRAFT_STRATEGY_NGRAM,
    DraftStrategy.model: common_pb2.DRAFT_STRATEGY_MODEL,
    DraftStrategy.hybrid: common_pb2.DRAFT_STRATEGY_HYBRID,
    DraftStrategy.suffix: common_pb2.DRAFT_STRATEGY_SUFFIX,
}
STRATEGY_FROM_PB = {pb: s for s, pb in STRATEGY_TO_PB.items()}  # UNSPECIFIED is absent: server default

FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,  # not the last message
    FinishReason.stop: common_pb2.FINISH_REASON_STOP,
    FinishReason.length: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.cancelled: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.error: common_pb2.FINISH_REASON_ERROR,
}
FINISH_FROM_PB = {pb: f for f, pb in FINISH_TO_PB.items()}


def strategy_name(pb: int) -> str:
    """A DraftStrategy value as its proto name, for error messages (unknown numbers as numbers)."""
    return common_pb2.DraftStrategy.Name(pb) if pb in common_pb2.DraftStrategy.values() else str(pb)


def strategy_from_proto(pb: int) -> DraftStrategy | None:
    """A requested strategy: None for UNSPECIFIED (the server's default). proto3 enums are open, so
    a peer may send any int32; a number this build does not know raises ValueError rather than
    falling back to some other strategy the client did not ask for."""
    if pb == common_pb2.DRAFT_STRATEGY_UNSPECIFIED:
        return None
    if pb not in STRATEGY_FROM_PB:
        known = ", ".join(f"{common_pb2.DraftStrategy.Name(v)} ({v})" for v in sorted(STRATEGY_FROM_PB))
        raise ValueError(f"unknown strategy {pb}: expected one of {known}, or UNSPECIFIED (0) for the server default")
    return STRATEGY_FROM_PB[pb]


def _invalid(what: str, exc: ValidationError) -> ValueError:
    """A pydantic error as one line naming each bad field and the value received, e.g.
    "invalid sampling parameters: temperature = nan: Input should be less than or equal to 100"."""

    def one(e) -> str:
        if not e["loc"]:  # a model-level check (e.g. ngram_min <= ngram_max): its message says it all
            return e["msg"]
        got = repr(e["input"])
        return f"{'.'.join(map(str, e['loc']))} = {got if len(got) <= 40 else got[:37] + '...'}: {e['msg']}"

    return ValueError(f"invalid {what}: {'; '.join(map(one, exc.errors()))}")


# -- sampling and speculation -------------------------------------------------------------------


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
        stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias), min_p=s.min_p, stop=list(s.stop),
    )
    if s.top_logprobs is not None:
        msg.top_logprobs = s.top_logprobs
    if s.grammar is not None:
        if s.grammar.kind == "json_object":
            msg.grammar.json_object = True
        else:
            setattr(msg.grammar, s.grammar.kind, s.grammar.value)
    if s.seed is not None:  # presence matters: seed 0 is a seed
        msg.seed = s.seed
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_new_tokens: int = 128) -> SamplingParams:
    """Raises ValueError naming the field for out-of-range values (NaN and inf included)."""
    try:
        return SamplingParams(
            temperature=msg.temperature,
            top_p=msg.top_p if msg.top_p != 0 else 1.0,  # proto: 0 = off
            top_k=msg.top_k,
            seed=msg.seed if msg.HasField("seed") else None,
            max_new_tokens=msg.max_new_tokens or default_max_new_tokens,
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            repetition_penalty=msg.repetition_penalty or 1.0,  # proto: 0 = off
            logit_bias=tuple(sorted(msg.logit_bias.items())),
            min_p=msg.min_p,
            stop=tuple(msg.stop),
            top_logprobs=msg.top_logprobs if msg.HasField("top_logprobs") else None,
            grammar=grammar_from_proto(msg.grammar) if msg.HasField("grammar") else None,
        )
    except ValidationError as exc:
        raise _invalid("sampling parameters", exc) from None


def spec_to_proto(spec: SpecConfig) -> common_pb2.SpeculationParams:
    return common_pb2.SpeculationParams(
        strategy=STRATEGY_TO_PB[spec.strategy], max_draft_tokens=spec.max_draft_tokens, adaptive=spec.adaptive,
    )


def spec_from_proto(msg: common_pb2.SpeculationParams, default: SpecConfig) -> SpecConfig:
    """`default` filled in by what the message sets. Raises ValueError for an unknown strategy
    number and for out-of-range values."""
    update: dict = {}
    strategy = strategy_from_proto(msg.strategy)
    if strategy is not None:
        update["strategy"] = strategy
    if msg.max_draft_tokens:
        update["max_draft_tokens"] = msg.max_draft_tokens
    if msg.HasField("adaptive"):
        update["adaptive"] = msg.adaptive
    try:
        return SpecConfig.model_validate({**default.model_dump(), **update})
    except ValidationError as exc:
        raise _invalid("speculation parameters", exc) from None


def stats_to_proto(s: SpecStats) -> common_pb2.SpeculationStats:
    return common_pb2.SpeculationStats(
        drafted=s.drafted, accepted=s.accepted, recovered=s.recovered, bonus=s.bonus, steps=s.steps,
        mean_accepted_len=s.mean_accepted_len, fallback_steps=s.fallback_steps,
        rejected_blocks=s.rejected_blocks, prefill_reused_tokens=s.prefill_reused_tokens,
        prefill_computed_tokens=s.prefill_computed_tokens, plain_steps=s.plain_steps,
        prefill_time_us=int(s.prefill_seconds * 1e6), decode_time_us=int(s.decode_seconds * 1e6),
    )


def stats_from_proto(msg: common_pb2.SpeculationStats) -> SpecStats:
    """The request's counters as the engine keeps them (per-position and per-proposer breakdowns
    do not travel; `mean_accepted_len` follows from accepted and steps)."""
    return SpecStats(
        drafted=msg.drafted, accepted=msg.accepted, recovered=msg.recovered, bonus=msg.bonus,
        steps=msg.steps, spec_steps=msg.steps - msg.plain_steps, fallback_steps=msg.fallback_steps,
        rejected_blocks=msg.rejected_blocks, prefill_reused_tokens=msg.prefill_reused_tokens,
        prefill_computed_tokens=msg.prefill_computed_tokens,
        prefill_seconds=msg.prefill_time_us / 1e6, decode_seconds=msg.decode_time_us / 1e6,
    )


# -- verifier -----------------------------------------------------------------------------------


def verifier_request_to_proto(req: VerifierRequest) -> verifier_pb2.SessionGenerateRequest:
    return verifier_pb2.SessionGenerateRequest(
        session_id=req.session_id, context_ids=req.context_ids, sampling=sampling_to_proto(req.sampling),
        speculation=spec_to_proto(req.spec), drafter_address=req.drafter_address, cache_salt=req.cache_salt,
        resumed_tokens=req.resumed_tokens, admission_wait_ms=round(req.admission_wait_s * 1000),
    )


def logprobs_to_proto(items) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token_id=t.token, logprob=t.logprob, top_ids=[i for i, _ in t.top],
                                    top_logprobs=[lp for _, lp in t.top]) for t in items or ()]


def logprobs_from_proto(msgs) -> tuple[TokenLogprob, ...] | None:
    if not msgs:
        return None
    return tuple(TokenLogprob(m.token_id, m.logprob, tuple(zip(m.top_ids, m.top_logprobs))) for m in msgs)


def grammar_from_proto(msg: common_pb2.GrammarConstraint) -> Grammar | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    return Grammar(kind=kind, value="" if kind == "json_object" else getattr(msg, kind))


def step_to_proto(step: StepOutput) -> verifier_pb2.CommittedTokens:
    return verifier_pb2.CommittedTokens(
        token_ids=step.tokens, first_index=step.first_index,
        step=verifier_pb2.StepInfo(drafted=step.drafted, accepted=step.accepted, block_len=step.block_len),
        logprobs=logprobs_to_proto(step.logprobs),
    )


def result_to_proto(result: GenerationResult) -> verifier_pb2.CommittedTokens:
    """The stream's last message: nothing more committed, the finish reason and the counters."""
    return verifier_pb2.CommittedTokens(
        first_index=len(result.token_ids), finish_reason=FINISH_TO_PB[result.finish_reason],
        stats=stats_to_proto(result.stats),
    )


def committed_from_proto(msg: verifier_pb2.CommittedTokens) -> CommittedTokens:
    """UNSPECIFIED finish = not the last message; an unknown reason reads as an error."""
    final = msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    return CommittedTokens(
        token_ids=tuple(msg.token_ids), first_index=msg.first_index,
        drafted=msg.step.drafted, accepted=msg.step.accepted, block_len=msg.step.block_len,
        finish_reason=FINISH_FROM_PB.get(msg.finish_reason, FinishReason.error) if final else None,
        stats=stats_from_proto(msg.stats) if msg.HasField("stats") else None,
        logprobs=logprobs_from_proto(msg.logprobs),
    )


def verifier_info_to_proto(rec: VerifierRecord, vocab_size: int, eos_token_ids: list[int]) -> verifier_pb2.VerifierInfo:
    return verifier_pb2.VerifierInfo(
        verifier_id=rec.verifier_id, model_id=rec.model_id, vocab_size=vocab_size,
        max_context_tokens=rec.max_context_tokens, kv_capacity_tokens=rec.kv_capacity_tokens,
        kv_used_tokens=rec.kv_used_tokens, active_sessions=rec.active_sessions, eos_token_ids=eos_token_ids,
        draining=rec.draining, precision=rec.precision,
    )


def verifier_record_from_proto(msg: verifier_pb2.VerifierInfo, address: str) -> VerifierRecord:
    """A GetInfo answer as routing sees it; `address` is where the caller reached it."""
    return VerifierRecord(
        verifier_id=msg.verifier_id, address=address, model_id=msg.model_id,
        max_context_tokens=msg.max_context_tokens, kv_capacity_tokens=msg.kv_capacity_tokens,
        kv_used_tokens=msg.kv_used_tokens, active_sessions=msg.active_sessions, updated_at=time.time(),
        draining=msg.draining, precision=msg.precision,
    )


# -- drafter ------------------------------------------------------------------------------------


def draft_open_to_proto(req: DraftSessionOpen) -> drafter_pb2.OpenSession:
    return drafter_pb2.OpenSession(
        context_ids=req.context_ids, strategy=STRATEGY_TO_PB[req.strategy], max_draft_tokens=req.max_draft_tokens,
        sampling=sampling_to_proto(req.sampling), vocab_size=req.vocab_size, next_block_len=req.next_block_len,
        target_model=req.target_model, cache_scope=req.cache_scope, token_trees=req.token_trees,
        trace_context=req.trace_context,
    )


def draft_block_to_proto(block: DraftBlock) -> drafter_pb2.DraftBlock:
    return drafter_pb2.DraftBlock(
        session_id=block.session_id, base_len=block.base_len, token_ids=block.token_ids,
        proposals=[drafter_pb2.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in block.proposals],
        proposer=block.proposer, draft_time_us=block.draft_time_us, speculative=block.speculative,
        confidence=block.confidence, parents=block.parents,
    )


def draft_block_from_proto(msg: drafter_pb2.DraftBlock) -> DraftBlock:
    return DraftBlock(
        session_id=msg.session_id, base_len=msg.base_len, token_ids=list(msg.token_ids),
        proposals=[(list(d.token_ids), list(d.probs)) for d in msg.proposals],
        proposer=msg.proposer, confidence=msg.confidence, speculative=msg.speculative,
        draft_time_us=msg.draft_time_us, parents=list(msg.parents),
    )


def drafter_info_to_proto(info: DrafterInfo) -> drafter_pb2.DrafterInfo:
    return drafter_pb2.DrafterInfo(
        drafter_id=info.drafter_id, strategies=[STRATEGY_TO_PB[s] for s in info.strategies],
        model_id=info.model_id, vocab_size=info.vocab_size, active_sessions=info.active_sessions,
    )


def drafter_info_from_proto(msg: drafter_pb2.DrafterInfo) -> DrafterInfo:
    """Strategies this build does not know are left out."""
    return DrafterInfo(
        drafter_id=msg.drafter_id,
        strategies=tuple(STRATEGY_FROM_PB[s] for s in msg.strategies if s in STRATEGY_FROM_PB),
        model_id=msg.model_id, vocab_size=msg.vocab_size, active_sessions=msg.active_sessions,
    )
