"""The drafter's domain object: per-session draft state and the draft-ahead pipeline.

No gRPC here: `server.py` unpacks requests, calls `DrafterCore` and packs its `DraftBlock`s
(tandem.serving.messages).

Sessions. A verifier opens a session with its context, then commits what each verification step
accepted; the core answers with blocks of drafts. Sessions are keyed by (owner, session_id), the
owner being the Draft stream that opened them, so a session moved to another verifier (a new
stream re-opening the same id) never shares state with, or is closed by, the stream it left.
A session closed without an error is *parked*: its proposer (a draft model's KV cache, the
prompt-lookup and suffix indexes) waits, within DrafterSettings.parked_sessions / parked_tokens,
for the same stream to open the same session again, which is what an agent's next turn does; the
proposer then resyncs to the new context by their common prefix (a draft model reads only the
new tokens, not the whole conversation again), exactly as a re-open of a session still open does.

Draft-ahead. While the verifier checks the block just sent (the *anchor*), the core drafts the
next one on the guess that the anchor is accepted whole and followed by a guessed bonus token:

    context ids[0:13]; regular block R: base 13, [a b c d]          (verifier checks R now)
    speculative S: base 17, [g e f h i]    g = guessed bonus at 17, e f h i drafts from 18
    Commit(committed_len=18, appended=[a b c d g]) -> S is consistent: the verifier trims g and
        verifies [e f h i] at once; the core drafts no regular block, only the next S' (based
        at 22, assuming e f h i and a guessed bonus), again overlapping verification.
    Commit(committed_len=15, appended=[a x])       -> S is stale (wasted): a fresh regular
        block at 15, then a speculative block after it.

`open` and `commit` validate and update the state at once, and return a lazy iterator of blocks:
the regular block is drafted when the caller asks for the first item, the speculative block only
when it asks for the next, so the caller can send the regular block before drafting ahead. That
ordering is what lets the speculative drafting overlap verification.

Accounting: a speculative block is *used* when it is consistent at the next commit, *wasted*
otherwise (or when its session closes first). hidden_fraction = drafting seconds of used
speculative blocks / all drafting seconds: the share of drafting taken off the critical path.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tandem.contract.params import DraftStrategy, SamplingParams
from tandem.engine.native.threads import ComputeThread
from tandem.engine.speculation.draft import Draft, Proposer
from tandem.engine.speculation.proposers import DraftModelProposer, HybridProposer, NgramProposer
from tandem.engine.speculation.sampling import make_generator
from tandem.engine.speculation.suffix import SuffixProposer, SuffixStores
from tandem.services.drafter.settings import DrafterSettings
from tandem.serving.messages import DraftBlock, DrafterInfo
from tandem.serving.telemetry import tracer

log = logging.getLogger("tandem.drafter")


class DrafterError(Exception):
    """A request the drafter refuses; the message says why (it reaches the verifier's logs)."""


class InvalidRequest(DrafterError):
    """Malformed or inconsistent input: a wrong committed_len, ids outside the vocabulary, ..."""


class UnknownSession(DrafterError):
    """A commit for a session that is not open (never opened, closed, or dropped after an error)."""


class Overloaded(DrafterError):
    """No room for another session (DrafterSettings.max_sessions)."""


@dataclass
class DrafterStats:
    """Counters of one drafter process. Seconds are drafting work (proposer time, lock waits
    excluded)."""

    sessions_opened: int = 0
    sessions_resumed: int = 0  # opened on a parked session's proposer (its next turn)
    regular_blocks: int = 0
    speculative_blocks: int = 0
    speculative_used: int = 0  # consistent with the commit that followed them
    speculative_wasted: int = 0  # inconsistent, or their session ended first
    draft_seconds: float = 0.0  # every block
    speculative_seconds: float = 0.0  # speculative blocks, used or not
    used_speculative_seconds: float = 0.0  # speculative blocks that were used: hidden by overlap
    # status name -> failed session messages (each dropped its session, or found it dropped)
    session_errors: Counter = field(default_factory=Counter)

    @property
    def hidden_fraction(self) -> float:
        return self.used_speculative_seconds / self.draft_seconds if self.draft_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "sessions_opened": self.sessions_opened,
            "sessions_resumed": self.sessions_resumed,
            "regular_blocks": self.regular_blocks,
            "speculative_blocks": self.speculative_blocks,
            "speculative_used": self.speculative_used,
            "speculative_wasted": self.speculative_wasted,
            "draft_seconds": self.draft_seconds,
            "speculative_seconds": self.speculative_seconds,
            "used_speculative_seconds": self.used_speculative_seconds,
            "hidden_fraction": self.hidden_fraction,
            "session_errors": dict(self.session_errors),
        }


def drafter_seed(seed: int) -> int:
    """The drafter's generator seed for a request seed. Derived, never equal: if the drafter drew
    its proposals from the very stream the verifier draws its acceptance tests from, the two would
    be correlated and rejection sampling would no longer be exact."""
    digest = hashlib.sha256(f"tandem.drafter:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class _Pending:
    """The last speculative block sent, with the context it assumed: the anchor's drafts from
    `start` on. It is consistent with a commit iff committed ids[start:] match `assumed` and the
    block still proposes something at or past the committed length."""

    block: DraftBlock
    start: int  # sequence index of assumed[0]
    assumed: list[int]  # anchor drafts from `start`, then the block's own tokens
    seconds: float


@dataclass
class _Session:
    session_id: str
    strategy: DraftStrategy
    proposer: Proposer
    sampling: SamplingParams
    gen: torch.Generator
    vocab_size: int
    max_block_len: int  # min(max_draft_tokens, settings.max_block_len)
    ids: list[int]  # committed ids: context, then every committed token (append-only)
    next_block_len: int
    max_id: int  # largest committed id (a draft model cannot embed ids past its vocabulary)
    lock: threading.Lock = field(default_factory=threading.Lock)
    epoch: int = 0  # bumped by every commit, so a lazy block iterator of an older one stops
    closed: bool = False
    anchor: DraftBlock | None = None  # the block the verifier is checking now (draft-ahead extends it)
    pending: _Pending | None = None
    span: object = None  # the session's `draft_session` span, parent of its draft_block spans
    park_key: tuple = ()  # where its proposer is parked when it closes (DrafterCore._park)


SessionKey = tuple[str, str]  # (owner, session_id)


class DrafterCore:
    """Per-session draft state for every stream of one drafter process. Thread safe: calls for
    different sessions may run concurrently; per-session state is guarded by the session's lock,
    the draft model (shared by all sessions, not thread safe) runs on its own thread, one call at
    a time. Lock order: sessions map -> session -> stats (a session's lock is held while it waits
    for the draft model's thread)."""

    def __init__(self, settings: DrafterSettings):
        self.settings = settings
        self._lock = threading.Lock()  # guards _sessions
        self._sessions: dict[SessionKey, _Session] = {}
        # The draft model's forwards all run on one thread (which also serialises them: the model
        # is not thread safe), not on whichever worker drafts: tandem.engine.native.threads.
        self._model_thread = ComputeThread("draft-model") if settings.draft_model is not None else None
        self._stats_lock = threading.Lock()
        self._stats = DrafterStats()
        model = settings.draft_model
        self._draft_vocab = int(model.model.get_input_embeddings().weight.shape[0]) if model else 0
        self._draft_context = model.max_context if model else 0  # positions the draft model reads
        # Suffix decoding's cross-session stores, one per (target model, tenant scope): a drafter
        # serving many verifiers sees every session's responses, which no single engine does.
        self.suffix_stores = SuffixStores(settings.suffix_store_tokens, settings.suffix_max_stores)
        # Closed sessions' proposers kept for their next turn, oldest first (guarded by _lock):
        # (owner, session_id, strategy, target model, tenant scope) -> (proposer, its tokens). The
        # key holds everything a proposer was built for, so a parked one only ever serves the same
        # stream's same session of the same model and tenant.
        self._parked: OrderedDict[tuple, tuple[Proposer, int]] = OrderedDict()
        self._parked_tokens = 0

    # -- session lifecycle ----------------------------------------------------------------------

    def open(
        self,
        session_id: str,
        context_ids: list[int],
        strategy: DraftStrategy,
        max_draft_tokens: int,
        sampling: SamplingParams,
        vocab_size: int,
        next_block_len: int,
        *,
        owner: str = "",
        target_model: str = "",
        cache_scope: str = "",
        token_trees: bool = False,
        trace_context: dict[str, str] | None = None,
    ) -> Iterator[DraftBlock]:
        """(Re)start a session; blocks: a regular one at len(context_ids) with up to
        next_block_len drafts, then a speculative one (none when next_block_len is 0).

        max_draft_tokens bounds the drafts of every block; 0 leaves only next_block_len and
        DrafterSettings.max_block_len as bounds. A speculative block carries its guessed bonus
        plus at most that many drafts. A context longer than DrafterSettings.max_context_tokens is
        refused (InvalidRequest), and so is a later commit that would grow the session past it.
        `token_trees`: the verifier verifies token trees for this session, so suffix decoding may
        send them (in regular blocks; settings.suffix_trees switches them off here).
        `trace_context`: the W3C context of the verifier's request (OpenSession.trace_context); the
        session's `draft_session` span is its child (without: a child of the current span).
        """
        if not session_id:
            raise InvalidRequest("session_id is empty")
        if strategy not in (DraftStrategy.ngram, DraftStrategy.model, DraftStrategy.hybrid, DraftStrategy.suffix):
            raise InvalidRequest(
                f"session {session_id}: strategy {strategy.value!r} cannot be drafted "
                "(ngram, suffix, model or hybrid; the verifier resolves the default before opening)"
            )
        if strategy in (DraftStrategy.model, DraftStrategy.hybrid) and self.settings.draft_model is None:
            raise InvalidRequest(
                f"session {session_id}: strategy {strategy.value!r} but drafter {self.settings.drafter_id} has no "
                "draft model (start it with a draft model, or use strategy 'ngram')"
            )
        if vocab_size <= 0:
            raise InvalidRequest(f"session {session_id}: vocab_size must be > 0, got {vocab_size}")
        limit = self.settings.max_context_tokens
        if len(context_ids) > limit:
            raise InvalidRequest(
                f"session {session_id}: context_ids holds {len(context_ids)} tokens, above drafter "
                f"{self.settings.drafter_id}'s max_context_tokens={limit}"
            )
        ids = [int(t) for t in context_ids]
        _check_ids(session_id, ids, vocab_size, "context_ids")
        key = (owner, session_id)
        with self._lock:
            old = self._sessions.get(key)
            if old is None and len(self._sessions) >= self.settings.max_sessions:
                raise Overloaded(
                    f"drafter {self.settings.drafter_id} holds {len(self._sessions)} sessions "
                    f"(max_sessions={self.settings.max_sessions}); session {session_id} refused"
                )
            park_key = (owner, session_id, strategy.value, target_model, cache_scope)
            reusable = None
            if old is not None:
                with old.lock:
                    self._end(old)
                    reusable = old.proposer
            else:
                reusable = self._unpark_locked(park_key)
            store = (self.suffix_stores.get(target_model, cache_scope)
                     if strategy in (DraftStrategy.suffix, DraftStrategy.hybrid) else None)
            session = _Session(
                session_id=session_id,
                strategy=strategy,
                proposer=self._proposer(strategy, vocab_size, reusable, store),
                sampling=sampling,
                gen=make_generator(None if sampling.seed is None else drafter_seed(sampling.seed)),
                vocab_size=vocab_size,
                max_block_len=min(max_draft_tokens or self.settings.max_block_len, self.settings.max_block_len),
                ids=ids,
                next_block_len=next_block_len,
                max_id=max(ids, default=-1),
                park_key=park_key,
            )
            resumed = reusable is not None and session.proposer is reusable
            session.proposer.begin(len(ids))
            session.proposer.allow_trees(token_trees and self.settings.suffix_trees)
            session.span = _session_span(session, trace_context)
            self._sessions[key] = session
        with self._stats_lock:
            self._stats.sessions_opened += 1
            self._stats.sessions_resumed += int(resumed)
        if next_block_len <= 0:
            return iter(())
        return self._blocks(session, session.epoch, regular=True)

    def commit(
        self, session_id: str, committed_len: int, appended_ids: list[int], next_block_len: int, *, owner: str = ""
    ) -> Iterator[DraftBlock]:
        """Extend the session by the committed tokens; blocks: nothing when the last speculative
        block is consistent (the verifier uses it) and a speculative block after it, else a fresh
        regular block at committed_len and a speculative block after that. Nothing at all when
        next_block_len is 0 (drafting paused; the state keeps following the commits)."""
        session = self._get(owner, session_id)
        appended = [int(t) for t in appended_ids]
        with session.lock:
            if session.closed:
                raise UnknownSession(f"session {session_id} is not open on this stream")
            expected = len(session.ids) + len(appended)
            if committed_len != expected:
                raise InvalidRequest(
                    f"session {session_id}: committed_len {committed_len} does not match the previous "
                    f"committed length {len(session.ids)} + {len(appended)} appended ids = {expected}"
                )
            limit = self.settings.max_context_tokens
            if expected > limit:
                raise InvalidRequest(
                    f"session {session_id}: committing {len(appended)} ids would grow it to {expected} "
                    f"tokens, above drafter {self.settings.drafter_id}'s max_context_tokens={limit}"
                )
            _check_ids(session_id, appended, session.vocab_size, "appended_ids")
            session.ids.extend(appended)
            session.max_id = max([session.max_id, *appended])
            session.epoch += 1
            session.next_block_len = next_block_len
            used = self._settle(session)
            session.anchor = used
            if next_block_len <= 0:
                session.anchor = None
                return iter(())
            return self._blocks(session, session.epoch, regular=used is None)

    def close(self, session_id: str, *, owner: str = "", error: str | None = None, finished: bool = False) -> bool:
        """Free a session's draft state; False when it was not open (closing twice is harmless).
        `error` names why it is dropped (counted in stats()["session_errors"]); `finished`: the
        generation ended normally (its last commit is in), so a suffix store keeps its response."""
        with self._lock:
            session = self._sessions.pop((owner, session_id), None)
        if error is not None:
            with self._stats_lock:
                self._stats.session_errors[error] += 1
        if session is None:
            return False
        with session.lock:
            if finished and error is None and not session.closed:
                session.proposer.finish(session.ids)
            # not after an error: whatever went wrong may have left the proposer inconsistent
            parkable = error is None and not session.closed
            self._end(session)
        if parkable:
            self._park(session.park_key, session.proposer, len(session.ids))
        return True

    def _park(self, key: tuple, proposer: Proposer, tokens: int) -> None:
        """Keep a closed session's proposer for its next turn; the oldest parked go first."""
        s = self.settings
        with self._lock:
            self._unpark_locked(key)
            if s.parked_sessions <= 0 or tokens > s.parked_tokens:
                return
            self._parked[key] = (proposer, tokens)
            self._parked_tokens += tokens
            while len(self._parked) > s.parked_sessions or self._parked_tokens > s.parked_tokens:
                self._parked_tokens -= self._parked.popitem(last=False)[1][1]

    def _unpark_locked(self, key: tuple) -> Proposer | None:  # the caller holds _lock
        entry = self._parked.pop(key, None)
        if entry is None:
            return None
        self._parked_tokens -= entry[1]
        return entry[0]


    def close_owner(self, owner: str) -> int:
        """Close every session of one stream (it ended or was cancelled); returns how many."""
        with self._lock:
            keys = [key for key in self._sessions if key[0] == owner]
            sessions = [self._sessions.pop(key) for key in keys]
            for key in [key for key in self._parked if key[0] == owner]:  # no later turn can reach them
                self._unpark_locked(key)
        for session in sessions:
            with session.lock:
                self._end(session)
        return len(sessions)

    def info(self) -> DrafterInfo:
        model = self.settings.draft_model
        with self._lock:
            active = len(self._sessions)
        return DrafterInfo(
            drafter_id=self.settings.drafter_id,
            strategies=(DraftStrategy.ngram, DraftStrategy.suffix)
            + ((DraftStrategy.model, DraftStrategy.hybrid) if model is not None else ()),
            model_id=model.model_id if model is not None else "",
            vocab_size=self._draft_vocab,
            active_sessions=active,
        )

    def stats(self) -> dict:
        with self._lock:
            active = len(self._sessions)
            parked, parked_tokens = len(self._parked), self._parked_tokens
        with self._stats_lock:
            out = self._stats.as_dict()
        out["active_sessions"] = active
        out["parked_sessions"], out["parked_tokens"] = parked, parked_tokens
        out["suffix"] = self.suffix_stores.stats()
        return out

    # -- internals ------------------------------------------------------------------------------

    def _get(self, owner: str, session_id: str) -> _Session:
        with self._lock:
            session = self._sessions.get((owner, session_id))
        if session is None:
            raise UnknownSession(f"session {session_id} is not open on this stream (open it first)")
        return session

    def _proposer(self, strategy: DraftStrategy, vocab_size: int, reusable: Proposer | None, store=None) -> Proposer:
        # A re-open (a new turn) usually extends the old context: reusing the proposer keeps its
        # n-gram index or draft KV cache, which resync to the new ids by their common prefix.
        if strategy == DraftStrategy.ngram:
            if isinstance(reusable, NgramProposer):
                return reusable
            return NgramProposer(self.settings.ngram_min, self.settings.ngram_max)
        if strategy == DraftStrategy.suffix:
            if isinstance(reusable, SuffixProposer) and reusable.store is store:
                return reusable
            return SuffixProposer(store, trees=True)
        if strategy == DraftStrategy.hybrid:
            if (isinstance(reusable, HybridProposer) and reusable.model.vocab_limit == vocab_size
                    and reusable.suffix is not None and reusable.suffix.store is store):
                return reusable
            return HybridProposer(
                NgramProposer(self.settings.ngram_min, self.settings.ngram_max),
                self._draft_model(vocab_size),
                min_lookup_match=self.settings.hybrid_min_match,
                suffix=SuffixProposer(store, trees=True),
            )
        if isinstance(reusable, DraftModelProposer) and reusable.vocab_limit == vocab_size:
            return reusable
        return self._draft_model(vocab_size)

    def _draft_model(self, vocab_size: int) -> DraftModelProposer:
        """The draft model's proposer for a session (alone or inside a hybrid), from the settings.
        No early stop here: the verifier's controller truncates each block by what it measured for
        the block's confidence, and drafting ahead hides the drafter's time."""
        s = self.settings
        return DraftModelProposer(s.draft_model, draft_top_k=s.draft_top_k, vocab_limit=vocab_size, stop_below=0.0,
                                  int8=s.draft_int8, context=s.draft_context)

    def _end(self, session: _Session) -> None:
        """Mark a session closed (its lazy iterators stop) and count its pending block as wasted."""
        session.closed = True
        if session.span is not None:
            session.span.end()
            session.span = None
        if session.pending is not None:
            with self._stats_lock:
                self._stats.speculative_wasted += 1
            session.pending = None
        session.anchor = None

    def _settle(self, session: _Session) -> DraftBlock | None:
        """Judge the pending speculative block against the commit just applied; return it when
        the verifier can use it."""
        pending, session.pending = session.pending, None
        if pending is None:
            return None
        ids, block = session.ids, pending.block
        committed = len(ids)
        end = block.base_len + len(_path(block))
        consistent = (
            block.base_len <= committed < end
            and (not block.parents or committed == block.base_len + 1)  # a tree: only its head trims off
            and ids[pending.start : committed] == pending.assumed[: committed - pending.start]
        )
        with self._stats_lock:
            if consistent:
                self._stats.speculative_used += 1
                self._stats.used_speculative_seconds += pending.seconds
            else:
                self._stats.speculative_wasted += 1
        return block if consistent else None

    def _blocks(self, session: _Session, epoch: int, *, regular: bool) -> Iterator[DraftBlock]:
        if regular:
            with session.lock:
                if session.closed or session.epoch != epoch:
                    return
                with tracer.start_as_current_span("draft_block", context=_in(session)) as span:
                    block = self._draft_regular(session)
                    _trace_block(span, session, block, speculative=False)
                session.anchor = block
            if block is None:
                return  # nothing was sent, so there is no block to guess the acceptance of
            yield block
        if not self.settings.lookahead:
            return
        with session.lock:
            if session.closed or session.epoch != epoch or session.anchor is None:
                return
            with tracer.start_as_current_span("draft_block", context=_in(session)) as span:
                block = self._draft_ahead(session)
                _trace_block(span, session, block, speculative=True)
        if block is not None:
            yield block

    def _draft_regular(self, session: _Session) -> DraftBlock | None:
        k = min(session.next_block_len, session.max_block_len)
        draft = self._propose(session, session.ids, k)
        if draft is None:
            # Say so rather than stay silent: the verifier then decodes plainly at once instead of
            # waiting for a block that is not coming.
            return DraftBlock(session_id=session.session_id, base_len=len(session.ids), token_ids=[], proposals=[],
                         proposer=session.strategy.value, draft_time_us=0, speculative=False, confidence=0)
        block = self._block(session, len(session.ids), draft, speculative=False)
        with self._stats_lock:
            self._stats.draft_seconds += draft.seconds
            if block is not None:
                self._stats.regular_blocks += 1
        return block

    def _draft_ahead(self, session: _Session) -> DraftBlock | None:
        """The speculative block after the anchor: [guessed bonus, up to k drafts], based at the
        anchor's end. Records it as pending; None when no guess exists."""
        anchor, ids = session.anchor, session.ids
        anchor_path = _path(anchor)  # a tree anchor: the guess is that its first path is accepted whole
        tail = anchor_path[len(ids) - anchor.base_len :]  # anchor drafts not yet committed
        k = min(session.next_block_len, session.max_block_len)
        if session.strategy in (DraftStrategy.ngram, DraftStrategy.suffix):
            # Prompt lookup (and suffix decoding) drafts by copying what followed an earlier occurrence; on the context
            # extended by the anchor, that match simply continues. So one lookup on the committed
            # ids yields the anchor's drafts, the bonus guess (the continuation token after them)
            # and the next drafts, and the n-gram index only ever holds committed tokens: no
            # rollback when the guess fails.
            draft = self._propose(session, ids, len(tail) + 1 + k, chain=True)
            if draft is None or draft.tokens[: len(tail)] != tail:
                return None
            draft = _drop_head(draft, len(tail))
            proposer = session.proposer
            if isinstance(proposer, SuffixProposer) and proposer.trees and len(draft) > 1:
                # In tree mode the drafts after the guess are a tree too, matched on the context
                # extended by the anchor and the guess (matched, never indexed): node 0 is the
                # guess, every other node descends from it, so the verifier trims the guess off.
                guess = draft.tokens[0]
                tree = proposer.propose_after(ids, tail + [guess], k)
                if tree.parents is not None and len(tree):
                    draft = Draft(tokens=[guess, *tree.tokens], proposer=tree.proposer, bucket=tree.bucket,
                                  seconds=draft.seconds + tree.seconds,
                                  parents=[-1] + [p + 1 for p in tree.parents])
        else:
            # The draft model's next token after the anchor is the bonus guess (argmax, or
            # sampled with its q); its KV cache rolls back cheaply when the guess fails.
            draft = self._propose(session, ids + tail, 1 + k)
            if draft is None:
                return None
        with self._stats_lock:
            self._stats.draft_seconds += draft.seconds
        block = self._block(session, anchor.base_len + len(anchor_path), draft, speculative=True)
        if block is None or len(block.token_ids) < 2:
            return None  # a guess with no drafts after it gives the verifier nothing to check
        session.pending = _Pending(
            block=block, start=len(ids), assumed=tail + _path(block), seconds=draft.seconds
        )
        with self._stats_lock:
            self._stats.speculative_blocks += 1
            self._stats.speculative_seconds += draft.seconds
        return block

    def _propose(self, session: _Session, ids: list[int], k: int, *, chain: bool = False) -> Draft | None:
        """`chain`: a chain even where the proposer drafts trees (drafting ahead extends a chain)."""
        if k <= 0 or not ids:
            return None
        if chain and isinstance(session.proposer, SuffixProposer):
            draft = session.proposer.propose_chain(ids, k, session.sampling, session.gen)
        elif session.strategy not in (DraftStrategy.model, DraftStrategy.hybrid):
            draft = session.proposer.propose(ids, k, session.sampling, session.gen)
        elif session.max_id >= self._draft_vocab or len(ids) >= self._draft_context:
            # The draft model can read neither an id it has no embedding for (the target committed
            # one) nor positions past its context window: there its drafts would be noise, and its
            # attention over a context whose length the caller chooses would cost time and memory
            # quadratic in it. Hybrid drafts by prompt lookup alone; model has nothing to offer.
            if session.strategy == DraftStrategy.model:
                return None
            draft = session.proposer.ngram.propose(ids, k, session.sampling, session.gen)
        else:
            k = min(k, self._draft_context - len(ids))  # every drafted position inside the window
            draft = self._model_thread.call(session.proposer.propose, ids, k, session.sampling, session.gen)
        return draft if len(draft) else None

    def _block(self, session: _Session, base_len: int, draft: Draft, *, speculative: bool) -> DraftBlock | None:
        """Pack a draft, cut at its first id outside [0, vocab_size) (the verifier would reject
        the whole block for it); None when nothing is left. A speculative block is a chain (a
        tree's first path) or a tree whose every node descends from node 0: its head is a guess that
        the verifier trims off."""
        if speculative and draft.parents is not None and (not draft.parents or draft.parents[0] != -1
                                                          or -1 in draft.parents[1:]):
            draft = draft.as_chain()
        tokens = draft.tokens
        n = next((i for i, t in enumerate(tokens) if not 0 <= t < session.vocab_size), len(tokens))
        if n == 0:
            return None
        proposals = []  # deterministic drafts: q is one-hot
        if draft.support is not None:
            # Only the support's entries of positive probability (the wire's promise: at a tiny
            # temperature the top-k holds tokens whose probability underflowed to 0, which add
            # nothing to q; the drafted token itself always has q > 0).
            for ids, probs in zip(draft.support[:n].tolist(), draft.support_probs[:n].tolist()):
                kept = [(t, p) for t, p in zip(ids, probs) if p > 0]
                proposals.append(([t for t, _ in kept], [p for _, p in kept]))
        return DraftBlock(
            session_id=session.session_id,
            base_len=base_len,
            token_ids=list(tokens[:n]),
            proposals=proposals,
            proposer=draft.proposer,
            draft_time_us=int(draft.seconds * 1e6),
            speculative=speculative,
            confidence=draft.bucket,
            parents=[] if draft.parents is None else list(draft.parents[:n]),  # a prefix of a tree is a tree
        )


def _session_span(session: _Session, trace_context: dict[str, str] | None):
    """A session's `draft_session` span: a child of the verifier request's context when it came
    with the session (one stream carries many requests' sessions), else of the current span."""
    from opentelemetry import propagate

    parent = propagate.extract(trace_context) if trace_context else None
    span = tracer.start_span("draft_session", context=parent)
    if span.is_recording():
        span.set_attributes({"tandem.session_id": session.session_id, "tandem.strategy": session.strategy.value,
                             "tandem.context_tokens": len(session.ids)})
    return span


def _in(session: _Session):
    """The context whose current span is the session's (for its draft_block spans)."""
    from opentelemetry import trace

    return trace.set_span_in_context(session.span) if session.span is not None else None


def _trace_block(span, session: _Session, block: DraftBlock | None, *, speculative: bool) -> None:
    """A draft block's span attributes (tandem.drafted = 0: the proposer had nothing to offer)."""
    if not span.is_recording():
        return
    span.set_attributes({
        "tandem.session_id": session.session_id,
        "tandem.proposer": block.proposer if block is not None else session.strategy.value,
        "tandem.speculative": speculative,
        "tandem.drafted": len(block.token_ids) if block is not None else 0,
        "tandem.base_len": block.base_len if block is not None else len(session.ids),
        "tandem.draft_time_us": block.draft_time_us if block is not None else 0,
        "tandem.next_block_len": session.next_block_len,
    })


def _check_ids(session_id: str, ids: list[int], vocab_size: int, what: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"session {session_id}: {what} holds id {bad}, outside [0, {vocab_size})")


def _path(block: DraftBlock) -> list[int]:
    """A block's tokens as the chain it guesses: a tree's first path (each node's first child)."""
    if not block.parents:
        return list(block.token_ids)
    return Draft(tokens=list(block.token_ids), proposer="", parents=list(block.parents)).as_chain().tokens


def _drop_head(draft: Draft, n: int) -> Draft:
    """The draft without its first n tokens (n-gram drafts carry no proposals)."""
    return Draft(tokens=draft.tokens[n:], proposer=draft.proposer, bucket=draft.bucket, seconds=draft.seconds)
