"""The verifier's side of a remote drafter, as a `Proposer`, with no transport in it.

The speculative loop does not know its drafter is remote: `peek` returns the best block that has
arrived for the current position (waiting a bounded time for one), `propose` hands it over, and
`on_commit` tells the drafter what the target committed. Blocks arrive on the connector's thread
(`DrafterConnector`, the small interface this module needs; drafter_client.py implements it over
gRPC, tests may implement it in-process).

Nothing a drafter sends can change the output, only the speed: a block is used only if it is based
at or before the committed length and its overlap equals the committed tokens (docs/design.md: stale
blocks are dropped and counted), its ids lie in the vocabulary, and its proposal distributions are
well formed. Everything else is counted in `rejected_blocks` and ignored. A drafter that dies or
stalls does not stop speculation: a step without a usable block in time (counted in
`fallback_steps`) drafts with the verifier's own prompt lookup when the session's strategy uses it
(microseconds of work, no model), else decodes plainly; the link reopens on its own.

Suffix decoding drafts from two indexes: the session's own tokens and the drafter's store of other
sessions' answers. The verifier keeps the first itself (`local_first`): the same index over the
same ids gives the drafter's own-index draft in microseconds, where waiting for the drafter costs
a round trip (1-2 ms on a loaded 2-core host, the network's on separate hosts: docs/history.md,
"Suffix decoding through the stack"). So a step waits for the drafter only while its blocks come
from the store (STORE_BUCKET and up), and at the first step; otherwise it drafts from the own index
or decodes plainly at once. A fresh block that is already there is always used, being the
drafter's best of both.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.engine.speculation.draft import Draft, Offer, Proposer, check_tree
from tandem.engine.speculation.suffix import STORE_BUCKET
from tandem.serving.messages import DraftBlock, DraftSessionOpen

# Suffix decoding asks its drafter for blocks this many times a step's drafts. A store-served block
# (another session's answer, followed on) costs the drafter nothing more to extend, and the rest of
# one is used by the next steps without waiting a round trip (`peek`), where blocks of one step's
# length made every store-served step wait for the next (agent_tools through the stack: 29 steps
# for an answer the store held whole, against 15-16 in process).
STORE_LOOKAHEAD = 4

log = logging.getLogger("tandem.verifier.drafting")

NOTHING = Draft(tokens=[], proposer="none")  # the drafter said it has no proposal for this position


# -- the connector interface ------------------------------------------------------------------


class DrafterUnavailable(Exception):
    """A link to a drafter could not be opened or broke; the message says why."""


class DraftLink(Protocol):
    """One session's open draft stream."""

    def commit(self, committed_len: int, appended_ids: list[int], next_block_len: int) -> None: ...

    def close(self, reason: str) -> None: ...


class DrafterConnector(Protocol):
    """Opens draft links to drafters by address. `on_block` and `on_lost` are called from the
    connector's own threads; `on_lost` at most once per link, never after `close`."""

    def open(
        self,
        address: str,
        request: DraftSessionOpen,
        *,
        on_block: Callable[[DraftBlock], None],
        on_lost: Callable[[str], None],
        headers: Sequence[tuple[str, str]] = (),
    ) -> DraftLink: ...

    def close(self) -> None: ...


# -- the proposer -------------------------------------------------------------------------------


@dataclass
class _Block:
    base_len: int
    tokens: list[int]
    support: list[list[int]] | None
    probs: list[list[float]] | None
    proposer: str
    confidence: int
    parents: list[int] | None = None  # a token tree (regular blocks only); None: a chain
    used: bool = False  # some step verified drafts from it (dropped later: spent, not rejected)


class RemoteProposer(Proposer):
    name = "remote"

    def __init__(
        self,
        connector: DrafterConnector,
        address: str,
        session_id: str,
        sampling: SamplingParams,
        spec: SpecConfig,
        vocab_size: int,
        *,
        wait_s: float = 0.010,
        retry_s: float = 1.0,
        headers: Sequence[tuple[str, str]] = (),
        others_busy: Callable[[], bool] = lambda: False,
        local: Proposer | None = None,
        target_model: str = "",
        cache_scope: str = "",
        token_trees: bool = False,
        local_first: bool = False,
    ):
        self.connector = connector
        self.address = address
        self.session_id = session_id
        self.sampling = sampling
        self.spec = spec
        self.vocab_size = vocab_size
        self.wait_s = wait_s
        self.retry_s = retry_s
        self.headers = tuple(headers)
        # True while other sessions share the verifier's batched forwards: then a session that
        # waits for its drafts delays nobody's forward but splits the batch, so it does not wait.
        self.others_busy = others_busy
        # Drafts a step whose remote block is late or missing (prompt lookup over the same ids).
        self.local = local
        # `local` drafts what the drafter's own-index part would (suffix decoding over the session's
        # ids): used at once, without waiting, unless the drafter's last block came from its store.
        self.local_first = local_first and local is not None
        self._store_recent = True  # the drafter's newest block drafted from its store (or none came yet)
        self.target_model, self.cache_scope = target_model, cache_scope  # the drafter's suffix store
        self.token_trees = token_trees  # the drafter may send token trees (OpenSession.token_trees)
        self._asked_trees = False  # what the open stream asked for
        self._known = 0  # committed length the drafter has been told
        self._local_offer: int | None = None  # committed length at which `local` offered
        self._paused = False  # the last commit asked for no drafts
        self.rejected_blocks = 0
        self.fallback_steps = 0
        self._cond = threading.Condition()
        self._blocks: list[_Block] = []
        self._link: DraftLink | None = None
        self._generation = 0  # which link the callbacks belong to: a lost old link is no news
        self._dead_since: float | None = None
        self._misses = 0
        self._offer: tuple[int, Draft, _Block] | None = None  # (committed len, trimmed draft, its block) from peek
        self._closed = False

    # -- link lifecycle -----------------------------------------------------------------------

    def open(self, context_ids: list[int]) -> None:
        """Start (or restart) the session on the drafter with the whole context."""
        with self._cond:
            self._blocks.clear()
            self._generation += 1
            generation = self._generation
        next_k = self._block_len(self.spec.max_draft_tokens)
        self._paused = False
        request = DraftSessionOpen(
            session_id=self.session_id, context_ids=list(context_ids), strategy=self.spec.strategy,
            max_draft_tokens=next_k, sampling=self.sampling,
            vocab_size=self.vocab_size, next_block_len=next_k,
            target_model=self.target_model, cache_scope=self.cache_scope, token_trees=self.token_trees,
        )
        self._known = len(context_ids)
        self._asked_trees = self.token_trees

        def on_block(block: DraftBlock) -> None:
            valid = self._validate(block)
            if valid is None:
                return
            with self._cond:
                if generation != self._generation:
                    return
                self._store_recent = bool(valid.tokens) and valid.confidence >= STORE_BUCKET
                self._blocks.append(valid)
                del self._blocks[:-8]  # only the newest few can still be useful
                self._cond.notify_all()

        def on_lost(reason: str) -> None:
            if not self._closed and generation == self._generation:
                self._mark_dead(reason)

        try:
            self._link = self.connector.open(self.address, request, on_block=on_block, on_lost=on_lost,
                                             headers=self.headers)
        except DrafterUnavailable as exc:
            self._link = None
            self._mark_dead(str(exc))
            return
        self._dead_since = None

    def _mark_dead(self, reason: str) -> None:
        if self._dead_since is None:
            log.warning("drafter stream of session %s lost (%s); decoding plainly until it returns",
                        self.session_id, reason)
        self._dead_since = time.monotonic()
        with self._cond:
            self._blocks.clear()
            self._cond.notify_all()

    def _validate(self, msg: DraftBlock) -> _Block | None:
        tokens = list(msg.token_ids)
        bad = None
        if msg.session_id and msg.session_id != self.session_id:
            bad = f"block for another session {msg.session_id!r}"
        elif not tokens and msg.speculative:
            bad = "empty speculative block"
        elif any(t < 0 or t >= self.vocab_size for t in tokens):
            bad = "token id outside the vocabulary"
        support = probs = None
        if bad is None and msg.proposals:
            if len(msg.proposals) != len(tokens):
                bad = f"{len(msg.proposals)} proposal distributions for {len(tokens)} tokens"
            else:
                support, probs = [], []
                for tok, (ids, ps) in zip(tokens, msg.proposals):
                    ids, ps = list(ids), list(ps)
                    total = sum(ps)
                    if (
                        len(ids) != len(ps) or not ids or tok not in ids or len(set(ids)) != len(ids)
                        or any(i < 0 or i >= self.vocab_size for i in ids)
                        or any(not math.isfinite(p) or p < 0 for p in ps)
                        or abs(total - 1.0) > 1e-3 or ps[ids.index(tok)] <= 0
                    ):
                        bad = "malformed proposal distribution"
                        break
                    support.append(ids)
                    probs.append(ps)
        parents = list(msg.parents) or None
        if bad is None and parents is not None:
            if not self._asked_trees:
                bad = "a token tree, which this session did not ask for"
            elif msg.proposals:
                bad = "a token tree with proposal distributions"
            elif msg.speculative and (len(parents) < 2 or parents[0] != -1 or -1 in parents[1:]):
                bad = "a speculative token tree whose nodes do not all descend from its guess (node 0)"
            else:
                bad = check_tree(tokens, parents)
        if bad is None and not self.sampling.greedy and not msg.proposals and msg.proposer == "model":
            # A sampling draft model must send q; without it the block cannot be verified exactly
            # (treating it as one-hot would bias the output), so it is useless, not harmful.
            bad = "sampled draft-model block without proposal distributions"
        if bad is not None:
            self.rejected_blocks += 1
            log.debug("dropped a draft block of session %s: %s", self.session_id, bad)
            return None
        return _Block(msg.base_len, tokens, support, probs, msg.proposer or "remote", msg.confidence, parents)

    # -- Proposer interface -------------------------------------------------------------------

    def _usable(self, ids: list[int]) -> tuple[Draft | None, _Block | None]:
        """The draft of the newest block that proposes tokens at len(ids) consistently with `ids`
        (NOTHING for a block that says it has none), and that block; (None, None) when there is
        none. Stale blocks are dropped and counted."""
        n = len(ids)
        keep, found = [], None
        for block in self._blocks:
            overlap = n - block.base_len
            if overlap < 0:
                keep.append(block)  # based in the future: maybe after the next commit
                continue
            if not block.tokens:  # "nothing to propose here": valid only at its own position
                if overlap == 0:
                    keep.append(block)
                    found = found or block
                continue
            if (overlap >= len(block.tokens) or block.tokens[:overlap] != ids[block.base_len:n]
                    or (block.parents is not None and overlap and (overlap > 1 or -1 in block.parents[1:]))):
                # a tree trims at most its head, and only where every other node descends from it
                if not block.used:
                    self.rejected_blocks += 1  # stale: never verified against the wrong position
                continue
            keep.append(block)
            found = block
        self._blocks = keep
        if found is None:
            return None, None
        if not found.tokens:
            return NOTHING, found
        overlap = n - found.base_len
        parents = found.parents
        if parents is not None and overlap:  # a speculative tree without its guess: node 0's children are roots
            parents = [p - 1 for p in parents[1:]]
        draft = Draft(tokens=found.tokens[overlap:], proposer=found.proposer, bucket=found.confidence,
                      parents=parents)
        if draft.parents is not None and not self.token_trees:
            draft = draft.as_chain()  # trees were allowed at open, not by this generation
        if found.support is not None:
            rows = list(zip(found.support[overlap:], found.probs[overlap:]))
            width = max(len(r[0]) for r in rows)
            # Pad supports to one width with zero-probability entries (token of the row itself).
            draft.support = torch.tensor([s + [s[0]] * (width - len(s)) for s, _ in rows], dtype=torch.long)
            draft.support_probs = torch.tensor([p + [0.0] * (width - len(p)) for _, p in rows], dtype=torch.float32)
        return draft, found

    def _fallback(self, ids: list[int]) -> Offer:
        """No usable block in time: the local proposer's offer, if there is one."""
        self.fallback_steps += 1
        return self._local(ids)

    def _local(self, ids: list[int]) -> Offer:
        if self.local is None:
            return Offer(self.name, 0, 0)
        offer = self.local.peek(ids)
        if offer.available > 0:
            self._local_offer = len(ids)
        return offer

    def peek(self, ids: list[int]) -> Offer:
        self._offer = None
        self._local_offer = None
        if self._paused:
            # We asked the drafter for nothing (the batch is compute-bound): no block is coming,
            # and none is late. The local prompt lookup can still offer a long match.
            return self._local(ids)
        if self._dead_since is not None:
            if time.monotonic() - self._dead_since >= self.retry_s:
                self.open(ids)  # the drafter may be back: reopen with the whole context
            else:
                return self._fallback(ids)
        if self.local_first:
            with self._cond:
                draft, block = self._usable(ids)
            if draft is NOTHING:
                return Offer(self.name, 0, 0)  # the drafter has nothing here, from either index
            if draft is not None and (block.base_len == len(ids) or draft.bucket >= STORE_BUCKET):
                return self._take(ids, draft, block)  # fresh (the drafter's best here), or the rest of a store draft
            if not self._store_recent:
                # The session's own index, as the drafter would draft it, a round trip sooner (the
                # rest of an own-index block too: drafted afresh, the longer context may match
                # longer). Where it has nothing the step decodes plainly: a block from the store,
                # if one is coming, arrives during this step and turns waiting back on.
                return self._local(ids)
        # A drafter that keeps missing its deadline gets no more waiting (a plain step costs less),
        # but every 8th step still waits, so a recovered drafter is noticed.
        wait = self.wait_s if (self._misses < 3 or self._misses % 8 == 0) else 0.0
        if self.others_busy():
            wait = 0.0
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                draft, block = self._usable(ids)
                remaining = deadline - time.monotonic()
                if draft is not None or remaining <= 0 or self._dead_since is not None:
                    break
                self._cond.wait(remaining)
        if draft is NOTHING:
            self._misses = 0  # the drafter answered in time: it just has no proposal here
            return Offer(self.name, 0, 0)
        if draft is None:
            self._misses += 1
            return self._fallback(ids)
        return self._take(ids, draft, block)

    def _take(self, ids: list[int], draft: Draft, block: _Block) -> Offer:
        self._misses = 0
        self._offer = (len(ids), draft, block)
        return Offer(draft.proposer, draft.bucket, len(draft), tree=draft.parents is not None)

    def propose(self, ids: list[int], k: int, sampling: SamplingParams, gen: torch.Generator | None) -> Draft:
        if self._local_offer == len(ids) and self.local is not None:
            return self.local.propose(ids, k, sampling, gen)
        if self._offer is None or self._offer[0] != len(ids):
            return Draft(tokens=[], proposer=self.name)
        if k > 0:
            self._offer[2].used = True
        return self._offer[1].truncated(k)

    def allow_trees(self, ok: bool) -> None:
        if not ok:
            self.token_trees = False
        if self.local is not None:
            self.local.allow_trees(ok and self.token_trees)

    def _block_len(self, k: int) -> int:
        """Drafts to ask the drafter for when a step may verify up to `k` (see STORE_LOOKAHEAD)."""
        return k * STORE_LOOKAHEAD if self.spec.strategy == DraftStrategy.suffix else k

    def on_commit(self, ids: list[int], appended: list[int], next_k: int) -> None:
        self._offer = None
        self._local_offer = None
        self._paused = next_k <= 0
        if self._link is None or self._dead_since is not None:
            return
        self._link.commit(len(ids), list(appended), self._block_len(next_k))
        self._known = len(ids)

    def finish(self, ids: list[int]) -> None:
        """The generation ended normally: for a strategy whose drafter keeps responses (suffix,
        hybrid), tell it the last step's tokens (drafting paused) before the close says
        "finished", so its store holds the whole response."""
        if self.spec.strategy not in (DraftStrategy.suffix, DraftStrategy.hybrid):
            return
        if self._link is None or self._dead_since is not None or self._closed or len(ids) <= self._known:
            return
        self._link.commit(len(ids), list(ids[self._known:]), 0)
        self._known = len(ids)

    def close(self, reason: str = "finished") -> None:
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            self._link.close(reason)
