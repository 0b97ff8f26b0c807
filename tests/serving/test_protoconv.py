"""tandem/serving/protoconv.py: domain objects survive the trip through the wire format exactly,
and what the proto comments promise about StepInfo and SpeculationStats is what the verifier fills."""

from __future__ import annotations

import re

import pytest

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.contract.results import GenerationResult, StepOutput
from tandem.contract.results import FinishReason, SpecStats
from tandem.engine.scheduler.generate import Engine
from tandem.serving import protoconv as pc
from tandem.serving.messages import DraftBlock, DrafterInfo, DraftSessionOpen, VerifierRequest
from tandem.v1 import common_pb2, drafter_pb2, verifier_pb2


def wire(msg):
    """Serialize and parse again, as a real peer would."""
    return type(msg).FromString(msg.SerializeToString())


def test_every_strategy_and_finish_reason_has_a_wire_value() -> None:
    assert set(pc.STRATEGY_TO_PB) == set(DraftStrategy)
    assert set(pc.FINISH_TO_PB) == {None, *FinishReason}
    assert pc.FINISH_TO_PB[None] == common_pb2.FINISH_REASON_UNSPECIFIED
    assert pc.strategy_name(common_pb2.DRAFT_STRATEGY_NGRAM) == "DRAFT_STRATEGY_NGRAM" and pc.strategy_name(99) == "99"


def test_sampling_and_speculation_roundtrip() -> None:
    # float32 on the wire: values exact in binary survive bit for bit (0.7 would come back 0.69999999)
    s = SamplingParams(temperature=0.75, top_p=0.875, top_k=5, seed=0, max_new_tokens=33, stop_token_ids=(4,),
                       ignore_eos=True)
    assert pc.sampling_from_proto(wire(pc.sampling_to_proto(s))) == s  # seed 0 survives: presence
    spec = SpecConfig(strategy=DraftStrategy.hybrid, max_draft_tokens=6, adaptive=False)
    assert pc.spec_from_proto(wire(pc.spec_to_proto(spec)), SpecConfig()) == spec
    # Unset fields take the server's defaults.
    default = SpecConfig(strategy=DraftStrategy.ngram, max_draft_tokens=3)
    assert pc.spec_from_proto(common_pb2.SpeculationParams(), default) == default


def test_unknown_strategy_numbers_are_refused_unspecified_is_the_default() -> None:
    """proto3 enums are open: a peer may send any int32. A number this build does not know is a
    clear ValueError (the servicers' INVALID_ARGUMENT), never a silent fallback or a KeyError."""
    default = SpecConfig(strategy=DraftStrategy.model, max_draft_tokens=3)
    assert pc.strategy_from_proto(common_pb2.DRAFT_STRATEGY_UNSPECIFIED) is None
    assert pc.spec_from_proto(wire(common_pb2.SpeculationParams(strategy=0)), default) == default
    assert pc.strategy_from_proto(common_pb2.DRAFT_STRATEGY_NONE) is DraftStrategy.none
    for number in (6, 57, -1, 2**31 - 1, -(2**31)):
        with pytest.raises(ValueError, match=f"unknown strategy {number}: expected one of .*DRAFT_STRATEGY_NGRAM"):
            pc.spec_from_proto(wire(common_pb2.SpeculationParams(strategy=number)), default)
        with pytest.raises(ValueError, match=f"unknown strategy {number}"):
            pc.strategy_from_proto(number)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(temperature=float("nan")), "invalid sampling parameters: temperature = nan: "),
    (dict(temperature=float("inf")), "temperature = inf: "),
    (dict(top_p=float("nan")), "top_p = nan: "),
    (dict(top_p=-0.5), "top_p = -0.5: Input should be greater than 0"),
    (dict(top_k=-1), "top_k = -1: "),
    (dict(max_new_tokens=2**32 - 1), "max_new_tokens = 4294967295: Input should be less than or equal to 1000000"),
    (dict(seed=2**64 - 1), "seed = 18446744073709551615: "),
])
def test_out_of_range_sampling_values_name_their_field(fields, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        pc.sampling_from_proto(wire(common_pb2.SamplingParams(**fields)))
    assert "\n" not in str(err.value)  # one line: it travels as a gRPC status message


def test_out_of_range_speculation_values_name_their_field() -> None:
    with pytest.raises(ValueError, match="invalid speculation parameters: max_draft_tokens = 65: "):
        pc.spec_from_proto(common_pb2.SpeculationParams(max_draft_tokens=65), SpecConfig())


def test_verifier_request_and_committed_tokens_roundtrip() -> None:
    req = VerifierRequest("s", [1, 2, 3], SamplingParams(max_new_tokens=9), SpecConfig(max_draft_tokens=5), "d:1")
    back = wire(pc.verifier_request_to_proto(req))
    assert (back.session_id, list(back.context_ids), back.drafter_address) == ("s", [1, 2, 3], "d:1")
    assert pc.sampling_from_proto(back.sampling) == req.sampling
    step = pc.committed_from_proto(wire(pc.step_to_proto(
        StepOutput(tokens=[7, 8], first_index=4, drafted=3, accepted=1, block_len=5))))
    assert (step.token_ids, step.first_index, step.drafted, step.accepted, step.block_len) == ((7, 8), 4, 3, 1, 5)
    assert step.finish_reason is None and step.stats is None
    stats = SpecStats(drafted=8, accepted=5, recovered=1, bonus=2, steps=3, spec_steps=2, fallback_steps=1,
                      rejected_blocks=2, prefill_reused_tokens=10, prefill_computed_tokens=4,
                      prefill_seconds=0.25, decode_seconds=1.5)
    last = pc.committed_from_proto(wire(pc.result_to_proto(GenerationResult(
        token_ids=[1] * 8, finish_reason=FinishReason.length, stats=stats, prompt_tokens=14, seconds=1.75,
        first_token_seconds=0.25))))
    assert last.finish_reason is FinishReason.length and last.first_index == 8 and last.token_ids == ()
    for name in ("drafted", "accepted", "recovered", "bonus", "steps", "spec_steps", "fallback_steps",
                 "rejected_blocks", "prefill_reused_tokens", "prefill_computed_tokens", "prefill_seconds",
                 "decode_seconds", "plain_steps", "mean_accepted_len"):
        assert getattr(last.stats, name) == getattr(stats, name), name
    # A finish reason this build does not know reads as an error, never as "not finished".
    odd = pc.committed_from_proto(verifier_pb2.CommittedTokens(finish_reason=77))
    assert odd.finish_reason is FinishReason.error


def test_draft_messages_roundtrip() -> None:
    open_ = DraftSessionOpen("s", [1, 2], DraftStrategy.model, 4, SamplingParams(temperature=1.0, seed=3), 512, 2)
    msg = wire(pc.draft_open_to_proto(open_))
    assert (list(msg.context_ids), msg.strategy, msg.max_draft_tokens, msg.vocab_size, msg.next_block_len) == \
        ([1, 2], common_pb2.DRAFT_STRATEGY_MODEL, 4, 512, 2)
    block = DraftBlock("s", 13, [4, 5], [([4, 9], [0.75, 0.25]), ([5], [1.0])], "model", 2, True, 900)
    assert pc.draft_block_from_proto(wire(pc.draft_block_to_proto(block))) == block
    info = DrafterInfo("d0", (DraftStrategy.ngram, DraftStrategy.model), "draft", 8192, 3)
    assert pc.drafter_info_from_proto(wire(pc.drafter_info_to_proto(info))) == info
    # Strategies from a newer peer that this build does not know are left out, not fatal.
    newer = drafter_pb2.DrafterInfo(drafter_id="d1", strategies=[common_pb2.DRAFT_STRATEGY_NGRAM, 42])
    assert pc.drafter_info_from_proto(newer).strategies == (DraftStrategy.ngram,)


def test_step_block_len_and_prefill_time_are_what_the_proto_says(tiny_loaded) -> None:
    """StepInfo.block_len is the block length the verifier asked for (>= drafted), and the stats
    carry the prefill and decode wall times (proto comments of StepInfo and SpeculationStats)."""
    engine = Engine(tiny_loaded)
    repetitive = [10, 11, 12, 13, 14] * 6  # prompt lookup finds a match at once
    gen = engine.start(repetitive, SamplingParams(max_new_tokens=24),
                       SpecConfig(strategy=DraftStrategy.ngram, adaptive=False, max_draft_tokens=4))
    steps = list(gen)
    assert all(s.block_len >= s.drafted for s in steps)
    assert any(s.block_len == 4 for s in steps), "fixed k = 4 is asked for whenever lookup offers drafts"
    result = gen.result()
    assert result.stats.prefill_seconds > 0 and result.stats.decode_seconds >= 0
    wire_stats = wire(pc.result_to_proto(result)).stats
    assert wire_stats.prefill_time_us == int(result.stats.prefill_seconds * 1e6)
    assert wire_stats.plain_steps == result.stats.steps - result.stats.spec_steps
