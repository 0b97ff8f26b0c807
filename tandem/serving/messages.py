"""The contract's messages as plain dataclasses: what the domain cores exchange with the other
services, with no protobuf in them. `protoconv` converts them to and from `tandem.v1`; the fields
and their units are those of protos/tandem/v1 (see the comment on each proto field).

    gateway  --VerifierRequest-->   verifier   --CommittedTokens-->  gateway
    verifier --DraftSessionOpen-->  drafter    --DraftBlock-->       verifier
    gateway  <--DrafterInfo--       drafter    (GetInfo)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.contract.results import FinishReason, SpecStats, TokenLogprob


@dataclass(frozen=True)
class VerifierRequest:
    """Generate the continuation of one session's token history (SessionGenerateRequest)."""

    session_id: str  # "" = one-off
    context_ids: list[int]  # the whole history including the new turn
    sampling: SamplingParams
    spec: SpecConfig
    drafter_address: str = ""  # "" = no drafter: plain decoding
    cache_salt: str = ""  # KV and prefix residency are shared only among requests of equal salt
    resumed_tokens: int = 0  # failover: the context's last N tokens are this request's output so far
    admission_wait_s: float = 0.0  # longest wait for KV room on a full verifier; 0 = the verifier's own


@dataclass(frozen=True)
class CommittedTokens:
    """Tokens committed by one verification step; the last message carries finish_reason and stats."""

    token_ids: tuple[int, ...]
    first_index: int  # output index of token_ids[0]
    drafted: int = 0  # drafts verified by the step
    accepted: int = 0  # drafts accepted (<= drafted)
    block_len: int = 0  # drafts the verifier asked for (0 = a planned plain step)
    finish_reason: FinishReason | None = None  # None: not the last message
    stats: SpecStats | None = None  # last message only
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when the request asked


@dataclass(frozen=True)
class DrafterInfo:
    """Identity and abilities of a drafter (Drafter.GetInfo)."""

    drafter_id: str
    strategies: tuple[DraftStrategy, ...]
    model_id: str = ""
    vocab_size: int = 0
    active_sessions: int = 0


@dataclass(frozen=True)
class DraftSessionOpen:
    """Start drafting for a session (OpenSession)."""

    session_id: str
    context_ids: list[int]  # every token of the session so far
    strategy: DraftStrategy
    max_draft_tokens: int
    sampling: SamplingParams
    vocab_size: int  # drafted ids must lie in [0, vocab_size)
    next_block_len: int  # drafts wanted in the first block; 0 = wait for the first commit
    target_model: str = ""  # with cache_scope: which suffix store the session reads and feeds
    cache_scope: str = ""  # opaque, derived from the tenant (suffix_scope); "" = the open scope
    token_trees: bool = False  # the verifier verifies token trees for this session (DraftBlock.parents)
    # W3C context (traceparent, tracestate) of the request the session drafts for: its spans' parent
    trace_context: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DraftBlock:
    """A block of drafted tokens as it arrived from a drafter, not yet validated (DraftBlock)."""

    session_id: str
    base_len: int  # committed length the block extends: token_ids[0] proposes index base_len
    token_ids: list[int]
    # Per drafted token (support ids, probabilities) of a sampling drafter; empty = one-hot drafts.
    proposals: list[tuple[list[int], list[float]]] = field(default_factory=list)
    proposer: str = ""
    confidence: int = 0  # the proposer's confidence bucket (n-gram: matched suffix length)
    speculative: bool = False  # drafted ahead, on the guess that the previous block is accepted whole
    draft_time_us: int = 0
    parents: list[int] = field(default_factory=list)  # a token tree: each token's parent (-1: base_len); empty = chain
