"""What a generation reports, in every tier's terms: why it ended, its speculation figures and the
log-probabilities of its tokens. The engine fills these, the verifier sends them over gRPC
(tandem.serving.protoconv) and the gateway renders them as OpenAI JSON; none of them needs torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    stop = "stop"  # a stop token (EOS or a requested stop id) was generated
    length = "length"  # max_new_tokens reached, or the context window is full
    cancelled = "cancelled"
    error = "error"


@dataclass
class SpecStats:
    """Speculation figures of one generation, in docs/design.md's terms. committed = accepted + steps."""

    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # drafts the target agreed with
    recovered: int = 0  # tokens emitted at a first rejection
    bonus: int = 0  # tokens emitted after every draft of a step was accepted (plain steps included)
    steps: int = 0  # target forwards of the decode loop
    spec_steps: int = 0  # steps that verified at least one draft
    fallback_steps: int = 0  # steps without a usable drafter block in time (local prompt lookup or plain)
    rejected_blocks: int = 0  # stale or garbage draft blocks that were dropped
    tree_steps: int = 0  # steps that verified a token tree with more than one branch
    tree_off_path: int = 0  # of those, steps whose accepted path left the tree's first path
    prefill_reused_tokens: int = 0
    prefill_computed_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0  # request start to the first committed token (set by result())
    decode_seconds: float = 0.0  # the decode loop after the first committed token (set by result())
    # accepted count per draft position: accepted_by_position[i] = steps whose draft i was accepted
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    # per proposer that drafted (a hybrid has two): {"steps", "drafted", "accepted"}
    by_proposer: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def mean_accepted_len(self) -> float:
        """Committed tokens per target step (1.0 for plain decoding)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def plain_steps(self) -> int:
        """Steps that verified no draft (strategy none, a choice of 0, or a fallback)."""
        return self.steps - self.spec_steps

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record(self, drafted: int, accepted: int, proposer: str | None = None, depth: int | None = None) -> None:
        """One step; `depth`: its drafts were a token tree of `drafted` nodes on `depth` levels (by
        position, a tree counts its levels)."""
        if proposer is not None and drafted:
            mine = self.by_proposer.setdefault(proposer, {"steps": 0, "drafted": 0, "accepted": 0})
            mine["steps"] += 1
            mine["drafted"] += drafted
            mine["accepted"] += accepted
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            self.spec_steps += 1
        if accepted == drafted:
            self.bonus += 1
        else:
            self.recovered += 1
        levels = drafted if depth is None else depth
        while len(self.drafted_by_position) < levels:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(levels):
            self.drafted_by_position[i] += 1
            if i < accepted:
                self.accepted_by_position[i] += 1

    def as_dict(self) -> dict:
        d = asdict(self)
        d["mean_accepted_len"] = self.mean_accepted_len
        d["acceptance_rate"] = self.acceptance_rate
        return d


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the target and the most probable alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most probable first


@dataclass
class StepOutput:
    tokens: list[int]  # newly committed output tokens of this step (after stop/length truncation)
    first_index: int  # index of tokens[0] among the generated tokens
    drafted: int
    accepted: int
    proposer: str | None = None  # which proposer drafted this step (None: a plain step)
    block_len: int = 0  # drafts the controller asked for (>= drafted: a proposer may offer fewer)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    # The proposer's fault counts after this step (fallback steps, rejected blocks), cumulative:
    # what the step added is the difference from the step before.
    faults: tuple[int, int] = (0, 0)


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: FinishReason
    stats: SpecStats
    prompt_tokens: int
    seconds: float  # decode time, prefill included
    first_token_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

