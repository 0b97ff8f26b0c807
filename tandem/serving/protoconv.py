"""Conversions between the typed config of `tandem.engine.config` / `tandem.engine.spec` and the `tandem.v1`
protobuf messages, in one place for every service and client."""

from __future__ import annotations

from tandem.engine.config import DraftStrategy, SamplingParams
from tandem.engine.spec import FinishReason
from tandem.v1 import common_pb2

STRATEGY_TO_PB = {
    DraftStrategy.none: common_pb2.DRAFT_STRATEGY_NONE,
    DraftStrategy.ngram: common_pb2.DRAFT_STRATEGY_NGRAM,
    DraftStrategy.model: common_pb2.DRAFT_STRATEGY_MODEL,
    DraftStrategy.hybrid: common_pb2.DRAFT_STRATEGY_HYBRID,
}
STRATEGY_FROM_PB = {pb: s for s, pb in STRATEGY_TO_PB.items()}  # UNSPECIFIED is absent: server default

FINISH_TO_PB = {
    FinishReason.stop: common_pb2.FINISH_REASON_STOP,
    FinishReason.length: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.cancelled: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.error: common_pb2.FINISH_REASON_ERROR,
}
FINISH_FROM_PB = {pb: f for f, pb in FINISH_TO_PB.items()}


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
        stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
    )
    if s.seed is not None:  # presence matters: seed 0 is a seed
        msg.seed = s.seed
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_new_tokens: int = 128) -> SamplingParams:
    """Raises ValueError (pydantic's ValidationError) for out-of-range values."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if 0 < msg.top_p <= 1 else 1.0,  # proto: 0 = off
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        max_new_tokens=msg.max_new_tokens or default_max_new_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )
