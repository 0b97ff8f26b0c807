"""What every proposer offers the verifier: a `Draft` (a chain or a token tree of guesses, with their
draft probabilities when sampled), an `Offer` of how much it expects to be accepted, and the
`Proposer` interface that local and remote proposers implement."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tandem.contract.params import SamplingParams


@dataclass
class Draft:
    tokens: list[int]  # proposed ids for positions base_len, base_len+1, ...
    proposer: str  # "ngram", "model", ... (metrics and adaptive stats are keyed by it)
    # Sparse proposal distribution q_i when the drafter sampled (None = deterministic, one-hot):
    support: torch.Tensor | None = None  # [k, s] int64 token ids of q_i's support
    support_probs: torch.Tensor | None = None  # [k, s] float32, rows sum to 1
    bucket: int = 0  # what the proposer knew about its confidence (ngram: matched suffix length)
    seconds: float = 0.0  # time spent drafting
    # A token tree instead of a chain: parents[i] is the node that tokens[i] follows (-1: the pending
    # token), always an earlier one, and siblings carry distinct tokens (check_tree). Deterministic
    # drafts only (no support). Nodes come best first, so the first k nodes are the best k-node tree.
    parents: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_tree(self) -> bool:
        """True for a tree with a branch (a chain given as a tree is verified as a chain)."""
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def truncated(self, k: int) -> "Draft":
        if k >= len(self.tokens):
            return self
        return Draft(
            tokens=self.tokens[:k],
            proposer=self.proposer,
            support=None if self.support is None else self.support[:k],
            support_probs=None if self.support_probs is None else self.support_probs[:k],
            bucket=self.bucket,
            seconds=self.seconds,
            parents=None if self.parents is None else self.parents[:k],
        )

    def depth(self) -> int:
        """Drafts on the longest path (the chain's length for a chain)."""
        if self.parents is None:
            return len(self.tokens)
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 + (depth[p] if p >= 0 else 0))
        return max(depth, default=0)

    def as_chain(self) -> "Draft":
        """The tree's first path (each node's first child: the most likely, nodes being best
        first), as a chain; a chain as it is."""
        if self.parents is None:
            return self
        path, cur = [], -1
        for i, p in enumerate(self.parents):
            if p == cur:
                path.append(i)
                cur = i
        return Draft(tokens=[self.tokens[i] for i in path], proposer=self.proposer, bucket=self.bucket,
                     seconds=self.seconds)

    def dense_probs(self, vocab: int) -> torch.Tensor | None:
        """q as a dense `# [k, vocab]` float32 tensor for the verification kernel (None = one-hot)."""
        if self.support is None:
            return None
        q = torch.zeros(len(self.tokens), vocab, dtype=torch.float32)
        q.scatter_(1, self.support, self.support_probs.float())
        return q


def check_tree(tokens: list[int], parents: list[int]) -> str | None:
    """Why `parents` is not a valid token tree over `tokens` (None: it is): one parent per token,
    each -1 or an earlier node, siblings' tokens distinct (a drafter's garbage is refused here,
    before a kernel that assumes the contract)."""
    if len(parents) != len(tokens):
        return f"{len(parents)} parents for {len(tokens)} tokens"
    seen: set[tuple[int, int]] = set()
    for i, (p, t) in enumerate(zip(parents, tokens)):
        if not -1 <= p < i:
            return f"node {i}'s parent {p} is not -1 or an earlier node"
        if (p, t) in seen:
            return f"node {i} repeats token {t} among its siblings"
        seen.add((p, t))
    return None


# A suffix-decoding draft's bucket from its cross-session store: STORE_BUCKET + the match length;
# from the session's own index: the length (at most 15). So a bucket says where a draft came from,
# to the controller and to a remote drafter's verifier (which drafts the session's own part itself:
# services/verifier/drafting.py). Here because the hybrid reads it too (tandem.engine.speculation.suffix imports
# this module).
STORE_BUCKET = 16


@dataclass
class Offer:
    """What a proposer can offer for the next step, known before drafting (cheaply)."""

    proposer: str  # name the acceptance statistics are keyed by
    bucket: int  # confidence bucket (n-gram: matched suffix length; 0 = no signal)
    available: int  # most drafts it can propose now; 0 = nothing (the step decodes plainly)
    # The bucket is known only after a costly look (a draft model's first step): the caller decides
    # from measured bucket frequencies whether that look pays, then calls `rate(proposer, ids)`.
    needs_peek: bool = False
    tree: bool = False  # the drafts come as a token tree (the controller keeps trees' counts apart)


UNBOUNDED = 1 << 30


# A draft model's confidence bucket: the probability it gives its own first draft, in 7 classes.
# Like prompt lookup's match length, it predicts acceptance far better than an average (a 2-layer
# draft of SmolLM2 is right about half the time overall, but rarely when it hesitates).
CONFIDENCE_EDGES = (0.3, 0.5, 0.7, 0.85, 0.93, 0.97)


def confidence_bucket(p: float) -> int:
    """1 (p < 0.3) .. 7 (p >= 0.97)."""
    return 1 + sum(p >= e for e in CONFIDENCE_EDGES)


class Proposer(ABC):
    name: str = "base"
    # True when proposing costs real time per token in this process (a local model); the
    # controller then weighs that cost against acceptance.
    costly: bool = False
    # Counters a remote proposer keeps (local proposers never fail nor send garbage).
    fallback_steps: int = 0  # steps decoded plainly because no usable block arrived in time
    rejected_blocks: int = 0  # stale or malformed blocks dropped

    def peek(self, ids: list[int]) -> Offer:
        """What `propose` could return for `ids`, without drafting."""
        return Offer(self.name, 0, UNBOUNDED)

    def offers(self, ids: list[int]) -> list[Offer]:
        """Every way this proposer could draft next (a hybrid has one per inner proposer); the
        caller values them and drafts with `propose_from` the best one's `proposer`."""
        return [self.peek(ids)]

    def propose_from(self, source: str, ids: list[int], k: int, sampling: SamplingParams,
                     gen: torch.Generator | None) -> Draft:
        return self.propose(ids, k, sampling, gen)

    def rate(self, source: str, ids: list[int]) -> Offer:
        """The full offer (with its bucket) for an offer that `needs_peek`."""
        return self.peek(ids)

    def per_token_seconds(self) -> float | None:
        """What one drafted token cost in the last propose, for a costly proposer (None: unknown)."""
        return None

    @abstractmethod
    def propose(self, ids: list[int], k: int, sampling: SamplingParams, gen: torch.Generator | None) -> Draft:
        """At most k tokens that follow `ids` (the committed tokens, pending one included)."""

    def on_commit(self, ids: list[int], appended: list[int], next_k: int) -> None:
        """A step committed `appended` (now the tail of `ids`); `next_k` drafts are wanted next."""

    def allow_trees(self, ok: bool) -> None:
        """Whether this generation can verify token trees (the backend runs them and nothing
        needs the drafts position by position); a proposer that drafts trees drafts chains if not."""

    def begin(self, context_len: int) -> None:
        """A generation starts after the first `context_len` tokens (the prompt): what follows
        is generated (penalties count it)."""

    def reset(self) -> None:
        """Forget per-sequence state (a new, unrelated sequence follows)."""

    def finish(self, ids: list[int]) -> None:
        """The generation ended normally with `ids` (prompt and output), before close(): a
        proposer that learns from finished responses (suffix decoding's store) keeps them."""

    def close(self, reason: str = "finished") -> None:
        """The generation ended: release resources (a remote proposer closes its session)."""

