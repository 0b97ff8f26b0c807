"""Suffix decoding: draft the most frequent continuation of the longest suffix of the context that
occurred before, in the session's own tokens or in earlier responses of other sessions.

The idea follows SuffixDecoding (Oliaro et al., arXiv 2411.04975): agents repeat themselves (the
same tool schemas, JSON shapes, code under edit, answers to the same system prompts), so a suffix
match often predicts a long continuation, and counting how often each continuation followed
the match predicts how far it will be accepted. The structure here is ours, chosen for a Python
drafter that keeps many of them in memory:

`SuffixIndex` answers the two queries a suffix tree answers for drafting, over a set of token
sequences: (1) the longest suffix of a pattern (up to `max_match` tokens) that occurs in them with
a continuation, and every such occurrence; (2) the counted tree of the continuations of those
occurrences. Instead of a tree node per substring (tens of nodes per token in Python objects), it
keeps, for a few gram sizes, the most recent occurrences of each gram ending there, and finds the
longest match by extending candidate occurrences backwards, token by token. Updates are
incremental (a committed token adds one entry per gram size); a lookup costs a few dictionary
probes plus at most `candidates` short backward comparisons. Continuations are read from the
sequences themselves, so a draft is not bounded by a tree depth.

`SuffixStore` is the global structure: recent responses of many sessions (each with the tail of
its prompt, so "the same question again" matches from the answer's first token), bounded by a
token budget, oldest evicted first. Stores are kept per (target model, tenant scope) by their
owner, so no tenant's text is ever drafted for another.

`SuffixProposer` drafts from both and lets the better candidate win by its score (the expected
number of accepted drafts: the sum over the chain of each prefix's empirical probability), with a
probability cut-off and a length limit that grows with the match length.
"""

from __future__ import annotations

import hashlib
import heapq
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from tandem.contract.params import SamplingParams
from tandem.engine.speculation.draft import STORE_BUCKET, Draft, Offer, Proposer

GRAM_SIZES = (1, 2, 4, 8, 16)  # grams indexed per position (a match of m tokens starts from the largest <= m)
CANDIDATES = 32  # most recent occurrences kept per gram
MAX_MATCH = 32  # longest match length measured (longer ones count as this)
PROMPT_TAIL = 32  # prompt tokens kept before a response in the global store
STORE_GRAM_SIZES = (4, 8, 16)  # the global store matches 4 tokens or more: shorter is weak evidence across sessions
_SHIFT, _MASK = 32, (1 << 32) - 1  # an occurrence (sid, end) as one int


def scope_of(tenant: str) -> str:
    """The opaque suffix-store scope of a tenant, as a verifier sends it to a drafter: equal for
    equal tenants, and no tenant name on the wire or in the drafter's memory ("" stays "")."""
    if not tenant:
        return ""
    return hashlib.sha256(f"tandem.suffix-scope:{tenant}".encode()).hexdigest()[:32]


@dataclass
class Match:
    """The longest suffix of a pattern found in an index: its length and every occurrence, as
    (sequence id, continuation start) pairs."""

    length: int = 0
    where: list[tuple[int, int]] = field(default_factory=list)


class SuffixIndex:
    """Occurrences of grams over a set of sequences (see the module docstring).

    An occurrence is (sequence id, end): the gram is seq[end - n:end] and its continuation starts
    at seq[end]. Only ends with a continuation are indexed (end < len(seq)), and only ends at or
    after a sequence's `first_end`, so the global store continues only into responses.

    Memory, measured (docs/history.md): a gram is keyed by its hash (a match checks the
    tokens, so a collision costs a comparison, never a wrong draft), an occurrence is one int
    (sid << 32 | end), and a gram seen once holds that int, not a list."""

    def __init__(self, *, gram_sizes: tuple[int, ...] = GRAM_SIZES, candidates: int | None = CANDIDATES,
                 max_match: int = MAX_MATCH):
        self.sizes = tuple(sorted(gram_sizes))
        self.candidates = candidates  # None: keep every occurrence (the brute-force tests use it)
        self.max_match = max_match
        self.seqs: dict[int, list[int]] = {}
        self._indexed: dict[int, int] = {}  # sequence id -> ends below this are indexed
        self._first: dict[int, int] = {}  # sequence id -> first end indexed
        # per gram size: hash of the gram -> one occurrence code, or a list of them, oldest first
        self._grams: dict[int, dict[int, int | list[int]]] = {n: {} for n in self.sizes}

    def add(self, sid: int, tokens: list[int], first_end: int = 1) -> None:
        """A new sequence (its ends from `first_end` on get indexed as they gain a continuation)."""
        if sid in self.seqs:
            raise ValueError(f"sequence {sid} is already indexed")
        if not 0 <= sid < 1 << 31:
            raise ValueError(f"sequence ids are 0 to 2**31 - 1, got {sid}")
        self.seqs[sid] = []
        self._indexed[sid] = max(1, first_end)
        self._first[sid] = max(1, first_end)
        self.extend(sid, tokens)

    def extend(self, sid: int, tokens: list[int]) -> None:
        """Append tokens to sequence `sid`: one entry per gram size for each end that now has a
        continuation."""
        seq = self.seqs[sid]
        seq.extend(int(t) for t in tokens)
        end = self._indexed[sid]
        cap = self.candidates
        while end < len(seq):  # end gains its continuation seq[end]
            for table, key, code in self._slots(seq, sid, end):
                held = table.get(key)
                if held is None:
                    table[key] = code
                elif isinstance(held, int):
                    table[key] = [held, code] if cap is None or cap > 1 else code
                else:
                    held.append(code)
                    if cap is not None and len(held) > cap:
                        del held[0]
            end += 1
        self._indexed[sid] = end

    def _slots(self, seq: list[int], sid: int, end: int):
        """(table, key, occurrence code) of each gram size's gram ending at `end` in `seq`."""
        code = sid << _SHIFT | end
        for n in self.sizes:
            if n > end:
                break
            yield self._grams[n], hash(tuple(seq[end - n:end])), code

    def remove(self, sid: int) -> None:
        """Forget a sequence and its occurrences."""
        seq = self.seqs.pop(sid)
        first, upto = self._first.pop(sid), self._indexed.pop(sid)
        for end in range(first, upto):
            for table, key, code in self._slots(seq, sid, end):
                held = table.get(key)
                if held is None:
                    continue
                if isinstance(held, int):
                    if held == code:
                        del table[key]
                    continue
                try:
                    held.remove(code)
                except ValueError:  # dropped already as one of the gram's older occurrences
                    continue
                if not held:
                    del table[key]
                elif len(held) == 1:
                    table[key] = held[0]

    def _recent(self, n: int, gram: list[int]) -> list[tuple[int, int]]:
        """Occurrences of `gram` (n tokens) kept, most recent first (hash collisions removed)."""
        held = self._grams[n].get(hash(tuple(gram)))
        if held is None:
            return []
        codes = [held] if isinstance(held, int) else reversed(held)
        out = []
        for code in codes:
            sid, end = code >> _SHIFT, code & _MASK
            if self.seqs[sid][end - n:end] == gram:
                out.append((sid, end))
        return out

    def match(self, pattern: list[int]) -> Match:
        """The longest suffix of `pattern` (at most max_match tokens) that occurs with a
        continuation, and all its occurrences among the candidates kept; most recent first."""
        cap = min(self.max_match, len(pattern))
        size, found = None, []
        for n in reversed(self.sizes):
            if n <= cap:
                found = self._recent(n, pattern[-n:])
                if found:
                    size = n
                    break
        if size is None:
            return Match()
        best, where = 0, []
        for sid, end in found:
            seq = self.seqs[sid]
            length = size
            while length < cap and end - length - 1 >= 0 and seq[end - length - 1] == pattern[-length - 1]:
                length += 1
            if length > best:
                best, where = length, [(sid, end)]
            elif length == best:
                where.append((sid, end))
        return Match(best, where)

    def continuations(self, where: list[tuple[int, int]], depth: int) -> "Continuations":
        return Continuations(self, where, depth)


class Continuations:
    """The counted tree of what followed a set of occurrences, read from the sequences on demand
    (a node is the list of occurrences that continue with its path)."""

    def __init__(self, index: SuffixIndex, where: list[tuple[int, int]], depth: int):
        self.index, self.root, self.depth = index, list(where), depth

    def children(self, node: list[tuple[int, int]], at: int) -> list[tuple[int, list[tuple[int, int]]]]:
        """(token, occurrences) after `node` at path depth `at`, most frequent first (most recent
        occurrence first on ties: `node` is ordered most recent first)."""
        seqs = self.index.seqs
        if len(node) == 1:  # one occurrence (most nodes past the first levels): no grouping to do
            sid, end = node[0]
            seq = seqs[sid]
            return [(seq[end + at], node)] if end + at < len(seq) else []
        groups: dict[int, list[tuple[int, int]]] = {}
        for sid, end in node:
            seq = seqs[sid]
            if end + at < len(seq):
                groups.setdefault(seq[end + at], []).append((sid, end))
        return sorted(groups.items(), key=lambda kv: -len(kv[1]))

    def best_chain(self, limit: int, min_prob: float) -> tuple[list[int], list[float]]:
        """The most frequent path, each step's cumulative probability (the share of the match's
        occurrences that continue with that whole prefix); stops below `min_prob` or at `limit`."""
        node, tokens, probs, p = self.root, [], [], 1.0
        total = len(self.root)
        depth = min(limit, self.depth)
        for at in range(depth):
            if len(node) == 1:  # one occurrence left: the rest of the chain is its continuation
                p = 1 / total
                if p < min_prob:
                    break
                sid, end = node[0]
                rest = self.index.seqs[sid][end + at:end + depth]
                tokens.extend(rest)
                probs.extend([p] * len(rest))
                break
            kids = self.children(node, at)
            if not kids:
                break
            tok, occ = kids[0]
            p = len(occ) / total
            if p < min_prob:
                break
            tokens.append(tok)
            probs.append(p)
            node = occ
        return tokens, probs


    def best_tree(self, nodes: int, limit: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
        """The most likely continuations as a token tree of at most `nodes` nodes and depth `limit`:
        best first (each node's probability is the share of the match's occurrences that continue
        with its whole path; a child's is never above its parent's, so every prefix of the list is
        a tree, the likeliest of its size). Returns (tokens, parents, probabilities); nodes below
        `min_prob` are left out. The first path (each node's first child) is `best_chain`'s."""
        total = len(self.root)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        heap: list[tuple[float, int, int, int, list[tuple[int, int]], int]] = []
        order = 0

        def push(node: list[tuple[int, int]], at: int, parent: int) -> None:
            nonlocal order
            if at >= min(limit, self.depth):
                return
            for tok, occ in self.children(node, at):
                p = len(occ) / total
                if p < min_prob:
                    break  # most frequent first: the rest are rarer
                heapq.heappush(heap, (-p, order, parent, tok, occ, at + 1))
                order += 1

        push(self.root, 0, -1)
        while heap and len(tokens) < nodes:
            neg_p, _, parent, tok, occ, at = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(parent)
            probs.append(-neg_p)
            push(occ, at, len(tokens) - 1)
        return tokens, parents, probs


class SuffixStore:
    """Recent responses of many sessions, for cross-session drafts: each held as the tail of its
    prompt (PROMPT_TAIL tokens, matched but never proposed) plus the response. Bounded by
    `max_tokens`; the oldest responses go first. Thread safe (a drafter serves many streams)."""

    def __init__(self, max_tokens: int = 100_000, *, min_response: int = 4, on_grow=None, **index_args):
        self.max_tokens = max_tokens
        self.min_response = min_response
        self.on_grow = on_grow  # called after each add, outside the lock (SuffixStores' shared budget)
        self.index = SuffixIndex(**{"gram_sizes": STORE_GRAM_SIZES, **index_args})
        self._order: deque[int] = deque()
        self._next = 0
        self._tokens = 0
        self.lock = threading.Lock()
        self.evicted = 0
        self._held: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None

    def hold(self) -> None:
        """From now on adds wait (a benchmark holds a prompt's answers until it measured every
        mode of it, so no prompt drafts from its own output)."""
        self._held = []

    def release(self, keep: bool = True) -> None:
        """Stop holding; `keep`: add what was held, once each (several modes give one answer)."""
        held, self._held = self._held or [], None
        if keep:
            for prompt, response in dict.fromkeys(held):
                self.add(list(prompt), list(response))

    def add(self, prompt: list[int], response: list[int]) -> bool:
        """Keep one finished response; False when too short to be worth keeping."""
        if len(response) < self.min_response or self.max_tokens <= 0:
            return False
        if self._held is not None:
            self._held.append((tuple(prompt), tuple(response)))
            return True
        tail = list(prompt[-PROMPT_TAIL:])
        seq = tail + list(response)
        if len(seq) > self.max_tokens:
            seq = seq[-self.max_tokens:]
            tail = []
        with self.lock:
            sid, self._next = self._next, self._next + 1
            self.index.add(sid, seq, first_end=max(1, len(tail)))
            self._order.append(sid)
            self._tokens += len(seq)
            while self._tokens > self.max_tokens and len(self._order) > 1:
                self._evict_oldest()
        if self.on_grow is not None:
            self.on_grow(self)
        return True

    def _evict_oldest(self) -> None:
        old = self._order.popleft()
        self._tokens -= len(self.index.seqs[old])
        self.index.remove(old)
        self.evicted += 1

    def evict_oldest(self) -> bool:
        """Drop the oldest response (a shared budget ran over); False when there is none."""
        with self.lock:
            if not self._order:
                return False
            self._evict_oldest()
            return True

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def responses(self) -> int:
        return len(self._order)


class SuffixStores:
    """One SuffixStore per (target model, tenant scope), the least recently used dropped beyond
    `max_stores`: a drafter serves many verifiers and tenants, and a tenant's text must only ever
    be drafted for that tenant. `max_tokens` bounds all of them together: past it, the least
    recently used store gives up its oldest responses first."""

    def __init__(self, max_tokens: int = 100_000, max_stores: int = 64):
        self.max_tokens, self.max_stores = max_tokens, max_stores
        self._stores: OrderedDict[tuple[str, str], SuffixStore] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, model: str, scope: str) -> SuffixStore:
        key = (model, scope)
        with self._lock:
            store = self._stores.get(key)
            if store is None:
                store = self._stores[key] = SuffixStore(self.max_tokens, on_grow=self._trim)
                while len(self._stores) > self.max_stores:
                    self._stores.popitem(last=False)
            else:
                self._stores.move_to_end(key)
            return store

    def _trim(self, grown: SuffixStore) -> None:
        """Over budget after `grown` took a response: the other stores give up their oldest
        responses first, least recently used first; `grown` last."""
        with self._lock:
            stores = [s for s in self._stores.values() if s is not grown] + [grown]
        total = sum(s.tokens for s in stores)
        for store in stores:
            while total > self.max_tokens and store.responses:
                before = store.tokens
                if not store.evict_oldest():
                    break
                total -= before - store.tokens
            if total <= self.max_tokens:
                return

    def stats(self) -> dict:
        with self._lock:
            stores = list(self._stores.values())
        return {"stores": len(stores), "responses": sum(s.responses for s in stores),
                "tokens": sum(s.tokens for s in stores)}


@dataclass
class _Candidate:
    source: str  # "local" or "global"
    length: int  # matched tokens
    tokens: list[int]
    probs: list[float]
    parents: list[int] | None = None  # a token tree (best_tree); None: a chain

    @property
    def score(self) -> float:
        """Expected accepted drafts: each node's probability of lying on the accepted path."""
        return sum(self.probs)


class SuffixProposer(Proposer):
    """Suffix decoding over the session's own tokens and, with a `store`, over earlier responses
    of other sessions (the store's owner scopes it to this model and tenant).

    Per step: the longest earlier match in each (at most MAX_MATCH tokens), the most frequent
    continuation of each, drafted while the share of occurrences that continue that way stays at
    or above `min_prob`, for at most `factor` x the match length; the candidate with the higher
    score (expected accepted drafts) wins. The offer's bucket is the match length (capped at 15),
    plus 16 for a global match, so the controller learns acceptance per source and length.
    A finished generation's response goes into the store.

    With `trees` (and where the caller's target runs trees, `allow_trees`) each candidate is a
    token tree instead: the likeliest continuations, best first, up to `tree_nodes` nodes, so that
    where earlier text went several ways one forward checks them all."""

    name = "suffix"
    TREE_NODES = 16  # most nodes of a tree (the controller takes as many of the best as pay)

    def __init__(self, store: SuffixStore | None = None, *, min_prob: float = 0.1, factor: float = 4.0,
                 max_len: int = 32, trees: bool = False, tree_nodes: int = TREE_NODES):
        self.store = store
        self.min_prob, self.factor, self.max_len = min_prob, factor, max_len
        self.tree_capable, self.tree_nodes = trees, tree_nodes
        self.trees = trees
        self.reset()

    def allow_trees(self, ok: bool) -> None:
        """Trees for this generation only where built for them and the caller can verify them."""
        trees = ok and self.tree_capable
        if trees != self.trees:
            self.trees = trees
            self._memo = None

    def propose_after(self, ids: list[int], extension: list[int], k: int) -> Draft:
        """Drafts (a tree in tree mode) for the position after `ids` + `extension`, where
        `extension` is not committed: it is matched as part of the pattern, never indexed (a
        drafter drafting ahead past a block the verifier has not checked yet)."""
        start = time.perf_counter()
        self._sync(ids)
        c = self._best(list(ids) + list(extension)) if k > 0 else None
        tokens = [] if c is None else c.tokens[:k]
        parents = None if c is None or c.parents is None else c.parents[:k]
        return Draft(tokens=tokens, proposer=self.name, bucket=0 if c is None else self._bucket(c),
                     seconds=time.perf_counter() - start, parents=parents)

    def propose_chain(self, ids: list[int], k: int, sampling: SamplingParams, gen: torch.Generator | None) -> Draft:
        """A chain whatever the mode (a drafter drafting ahead extends chains only)."""
        if not self.trees:
            return self.propose(ids, k, sampling, gen)
        self.trees, self._memo = False, None
        try:
            return self.propose(ids, k, sampling, gen)
        finally:
            self.trees, self._memo = True, None

    def reset(self) -> None:
        self.local = SuffixIndex()
        self.local.add(0, [])
        self._ids: list[int] = []  # our copy of the sequence (the caller's list changes in place)
        self._prompt_len: int | None = None
        self._memo: tuple[int, _Candidate | None] | None = None
        self._kept = False  # this generation's response went into the store

    def begin(self, context_len: int) -> None:
        self._prompt_len = context_len
        self._kept = False

    def _sync(self, ids: list[int]) -> None:
        n = len(self._ids)
        if n > len(ids) or self._ids != ids[:n]:  # a new or rewound sequence: start over
            prompt_len = self._prompt_len
            self.reset()
            self._prompt_len, n = prompt_len, 0
        if len(ids) > n:
            new = ids[n:]
            self.local.extend(0, new)
            self._ids.extend(new)
            self._memo = None

    def _limit(self, length: int) -> int:
        return max(1, min(self.max_len, int(self.factor * length)))

    def _candidate(self, ids: list[int]) -> _Candidate | None:
        self._sync(ids)
        if self._memo is not None and self._memo[0] == len(ids):
            return self._memo[1]
        best = self._best(ids)
        self._memo = (len(ids), best)
        return best

    def _best(self, pattern: list[int]) -> _Candidate | None:
        best = self._from(self.local, pattern, "local")
        if self.store is not None and self.store.responses:
            with self.store.lock:
                other = self._from(self.store.index, pattern, "global")
            if other is not None and (best is None or other.score > best.score):
                best = other
        return best

    def _from(self, index: SuffixIndex, ids: list[int], source: str) -> _Candidate | None:
        m = index.match(ids)
        if not m.length:
            return None
        cont = index.continuations(m.where, self.max_len)
        if self.trees and len(m.where) > 1:  # one occurrence cannot branch: its chain is the tree
            tokens, parents, probs = cont.best_tree(self.tree_nodes, self._limit(m.length), self.min_prob)
            if any(p != i - 1 for i, p in enumerate(parents)):
                return _Candidate(source, m.length, tokens, probs, parents)
            # one branch: the chain itself (planned and counted as one; it may run longer)
        tokens, probs = cont.best_chain(self._limit(m.length), self.min_prob)
        return _Candidate(source, m.length, tokens, probs) if tokens else None

    @staticmethod
    def _bucket(c: _Candidate) -> int:
        """The match length (at most 15), plus STORE_BUCKET in the store (adaptive._bucket groups them)."""
        return min(c.length, 15) + (STORE_BUCKET if c.source == "global" else 0)

    def peek(self, ids: list[int]) -> Offer:
        c = self._candidate(ids)
        if c is None:
            return Offer(self.name, 0, 0)
        return Offer(self.name, self._bucket(c), len(c.tokens), tree=c.parents is not None)

    def propose(self, ids: list[int], k: int, sampling: SamplingParams, gen: torch.Generator | None) -> Draft:
        start = time.perf_counter()
        c = self._candidate(ids) if k > 0 else None
        tokens = [] if c is None else c.tokens[:k]
        parents = None if c is None or c.parents is None else c.parents[:k]
        return Draft(tokens=tokens, proposer=self.name, bucket=0 if c is None else self._bucket(c),
                     seconds=time.perf_counter() - start, parents=parents)

    def on_commit(self, ids: list[int], appended: list[int], next_k: int) -> None:
        self._sync(ids)

    def finish(self, ids: list[int]) -> None:
        """The generation ended with `ids`: its response (what followed the prompt) joins the store."""
        if self._kept or self.store is None or self._prompt_len is None:
            return
        self._kept = True
        if self._prompt_len < len(ids):
            self.store.add(list(ids[: self._prompt_len]), list(ids[self._prompt_len:]))
