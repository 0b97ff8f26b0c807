"""Proposers: cheap guesses of the next tokens, checked later by the target.

One interface for every proposer, local or remote: `propose(ids, k, ...)` returns a `Draft` of at most
k tokens that would follow `ids`. A proposer can make generation faster or slower, never different:
the verifier alone decides which tokens are committed.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from tandem.contract.ids import common_prefix_len
from tandem.contract.params import SamplingParams, SpecConfig
from tandem.engine.model.loading import LoadedModel
from tandem.engine.speculation.draft import STORE_BUCKET, UNBOUNDED, Draft, Offer, Proposer, confidence_bucket
from tandem.engine.speculation.sampling import adjust_logits, argmax_rows, exp_noise


class NgramProposer(Proposer):
    """Prompt lookup: find the longest recent suffix of the context (ngram_max down to ngram_min
    tokens) that occurred earlier, and propose what followed it.

    Among the last few occurrences of that n-gram, the one whose match extends furthest back (up
    to MATCH_CAP tokens) wins, most recent on ties; the full match length is the draft's confidence
    bucket, because it predicts acceptance: a 20-token match inside a copied tool schema is
    accepted far more often than a 2-token one.

    The index is incremental: each committed token adds one entry per n, so a lookup costs O(n_max)
    dictionary probes plus a short backward comparison, however long the context (microseconds
    beside a ~30 ms target step).

    Example: context `def f(x): return x ... def f(` with n=3 matches `def f(` and proposes `x): return`.
    """

    name = "ngram"
    CANDIDATES = 4  # occurrences kept per n-gram (most recent)
    MATCH_CAP = 32  # longest match length measured

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        self.n_min, self.n_max = ngram_min, ngram_max
        self.reset()

    def reset(self) -> None:
        # _index[n][tuple of n ids] = end positions i of the most recent occurrences (oldest first),
        # i.e. the continuation starts at ids[i]. Only occurrences ending before len(ids) are
        # indexed, so the current suffix never matches itself.
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(self.n_min, self.n_max + 1)}
        self._ids: list[int] = []
        self._upto = 0  # end positions 1.._upto-1 are indexed
        self._last: tuple[int, tuple[int, int]] | None = None  # (len(ids), match): peek, then propose

    def _sync(self, ids: list[int]) -> None:
        n = self._upto
        # A new sequence or a rollback below what was indexed: start over (rare: new turn, new prompt).
        # The whole indexed prefix is compared: checking only its ends misses a divergence between
        # them, which would leave entries for n-grams the sequence no longer has. (A list comparison
        # runs at C speed, microseconds for thousands of ids beside a ~30 ms target step.)
        if n > len(ids) or self._ids != ids[:n]:
            self.reset()
        for end in range(max(self._upto, 1), len(ids)):
            for size in range(self.n_min, min(self.n_max, end) + 1):
                ends = self._index[size].setdefault(tuple(ids[end - size : end]), [])
                ends.append(end)
                if len(ends) > self.CANDIDATES:
                    del ends[0]
        # Our own copy: the caller's list may grow or change in place (a sequence's ids do).
        self._ids.extend(ids[len(self._ids) :])
        self._upto = len(self._ids)

    def _match(self, ids: list[int]) -> tuple[int, int]:
        """(match length, continuation start) of the best match; (0, -1) when none."""
        self._sync(ids)
        n = len(ids)
        # A step peeks, then proposes on the same ids: after _sync has checked them, the length
        # alone identifies them (any change of content resets the index and this memo).
        if self._last is not None and self._last[0] == n:
            return self._last[1]
        self._last = (n, self._find(ids))
        return self._last[1]

    def _find(self, ids: list[int]) -> tuple[int, int]:
        n = len(ids)
        for size in range(min(self.n_max, n), self.n_min - 1, -1):
            ends = self._index[size].get(tuple(ids[-size:]))
            if not ends:
                continue
            best_len, best_end = -1, -1
            for end in reversed(ends):  # most recent first: it wins ties
                length = size
                while length < self.MATCH_CAP and end - length - 1 >= 0 and ids[end - length - 1] == ids[n - length - 1]:
                    length += 1
                if length > best_len:
                    best_len, best_end = length, end
            return best_len, best_end
        return 0, -1

    def peek(self, ids: list[int]) -> Offer:
        size, end = self._match(ids)
        return Offer(self.name, size, len(ids) - end if size else 0)

    def propose(self, ids: list[int], k: int, sampling: SamplingParams, gen: torch.Generator | None) -> Draft:
        start = time.perf_counter()
        size, end = self._match(ids)
        tokens = ids[end : end + k] if size and k > 0 else []
        return Draft(tokens=list(tokens), proposer=self.name, bucket=size, seconds=time.perf_counter() - start)


class _DraftLM:
    """A draft model's forward with a rollbackable cache: the native Llama forward where the
    architecture allows (a draft step is a few layers, so per-module Python overhead would be most
    of its cost), `transformers` otherwise. The native weights are re-laid out once per model and
    shared by every proposer of that model. `int8`: int8 weights on a CPU (see llama._Int8Weight);
    off where a test needs the draft's exact numbers (the target as its own perfect draft)."""

    # model -> {int8: its native forward}
    _native: "weakref.WeakKeyDictionary[torch.nn.Module, dict[bool, object]]" = weakref.WeakKeyDictionary()

    def __init__(self, loaded: LoadedModel, *, int8: bool = True):
        from tandem.engine.model.llama import NativeLlama, Unsupported, check_supported

        self.device = next(loaded.model.parameters()).device
        try:
            check_supported(loaded.model)
            forwards = self._native.setdefault(loaded.model, {})
            if int8 not in forwards:
                forwards[int8] = NativeLlama(loaded.model, int8=int8)
            self.native = forwards[int8]
            self.cache = self.native.new_cache()
        except Unsupported:
            self.native, self.model, self.cache = None, loaded.model, DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.length if self.native is not None else self.cache.get_seq_length()

    def crop(self, length: int) -> None:
        if self.native is not None:
            self.cache.crop_to(length)
        elif self.cache.get_seq_length() > length:
            self.cache.crop(length - self.cache.get_seq_length())

    @torch.inference_mode()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens; logits after the last one `# [head_rows]` float32 on the CPU."""
        if self.native is not None:
            return self.native.forward_batch([(tokens, self.cache)], ["last"])[0][0].cpu()
        x = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float().cpu()


class DraftModelProposer(Proposer):
    """A small causal LM sharing the target's tokenizer, with its own rollbackable KV cache.

    Greedy requests get greedy drafts (one-hot q). Sampled requests get drafts sampled from the draft
    model's distribution at the request's temperature, truncated to its top `draft_top_k` tokens; that
    sparse q travels with the tokens so the verifier's rejection sampling stays exact.

    A draft whose LM head covers only part of the vocabulary (`LoadedModel.head_vocab`, from `tandem
    distill`) proposes only ids of that part: head row i stands for id head_vocab[i], and q's
    support is mapped the same way, so verification stays exact (an id outside is simply never
    proposed; the target still emits it as a recovered or bonus token).
    """

    name = "model"
    costly = True
    STEP_LIKE = 3  # feeds of up to this many tokens count as one drafting step
    # Under a grammar (SamplingParams.grammar: structured output, a required tool call) its drafts
    # follow the grammar too: the draft's logits are masked like the target's, from a matcher of
    # its own kept at the tokens generated so far. Likewise logit_bias and the presence, frequency
    # and repetition penalties: the draft's logits get the target's adjustments (sampling.
    # adjust_logits, with its own drafts counted as generated), so it does not keep proposing a
    # banned or penalized token the target will refuse. Only speed depends on either: the
    # verifier applies them to the target whatever a drafter sends.
    # A block stops early when the draft's probability for its next token falls below this: the
    # step after a hesitation is mostly rejected, and each extra draft costs a draft step and a
    # verified position. (Stopping on the draft's own numbers keeps sampling exact.)
    STOP_BELOW = 0.35
    # The draft reads at most the last CONTEXT tokens of a context it starts on (a new sequence, a
    # turn it cannot continue), and starts over there once its cache holds REWINDOW x that. Why: a
    # draft model's first look at a prompt is a prefill of its own, paid per session (measured: a
    # 1,300-token agent prompt, 90 ms on a 2-core Intel Xeon, about 16 target steps), while what
    # it predicts comes from the nearby tokens: `tandem distill` trains drafts on 256-token windows.
    # Which tokens a draft saw changes only its proposals, never what the verifier commits.
    CONTEXT = 512
    REWINDOW = 4

    def __init__(self, loaded: LoadedModel, *, draft_top_k: int = 16, vocab_limit: int | None = None,
                 stop_below: float | None = None, int8: bool = True, context: int | None = CONTEXT):
        if context is not None and context < 1:
            raise ValueError(f"context must be >= 1 token (None: all of it), got {context}")
        self.loaded = loaded
        self.context = context
        self.int8 = int8  # int8 weights on a CPU (_DraftLM)
        self.stop_below = self.STOP_BELOW if stop_below is None else stop_below  # 0: never stop early
        self.draft_top_k = draft_top_k
        self.head_vocab = loaded.head_vocab  # [head_rows] int64 or None
        # Never propose an id the target cannot score: clip the draft's head to the target vocab.
        self.vocab_limit = vocab_limit
        if vocab_limit is not None and self.head_vocab is not None:
            self._keep = self.head_vocab < vocab_limit  # [head_rows] bool
        # A reduced head's logits are adjusted (logit_bias, penalties) in a row this wide
        self._id_width = max(vocab_limit or 0, loaded.id_limit)
        self.reset()

    def reset(self) -> None:
        self.lm = _DraftLM(self.loaded, int8=self.int8)
        self._ids: list[int] = []  # the sequence read so far; the cache holds the KV of _ids[_base:]
        self._base = 0
        self.feed_seconds: list[float] = []  # short feeds of this step (its per-token cost)
        self._peeked: torch.Tensor | None = None  # next-token logits after self._ids, from peek
        self._grammar: _DraftGrammar | None = None  # the grammar state of the sequence, when it has one
        self._prompt_len: int | None = None  # where generation began (begin); None: at the first propose

    def begin(self, context_len: int) -> None:
        self._prompt_len = context_len

    def _adjusted(self, logits: torch.Tensor, sampling: SamplingParams, ids: list[int], drafted: list[int]) -> torch.Tensor:
        """`logits # [head_rows]` after the request's logit_bias and penalties at the position after
        `ids + drafted`, as the target's are adjusted there (tokens after the prompt count as generated)."""
        if self._prompt_len is None or self._prompt_len > len(ids):
            self._prompt_len = len(ids)
        prompt, generated = ids[: self._prompt_len], ids[self._prompt_len:] + drafted
        if self.head_vocab is None:
            return adjust_logits(logits[None], sampling, prompt, generated)[0]
        # A reduced head: its rows placed at their ids in a full row, adjusted there, read back.
        full = logits.new_full((1, self._id_width), float("-inf"))  # [1, vocab]
        full[0, self.head_vocab] = logits.float()
        return adjust_logits(full, sampling, prompt, generated)[0, self.head_vocab]  # [head_rows]

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens; return the logits after the last one `# [head_rows]`, ids outside the
        target's vocabulary masked."""
        start = time.perf_counter()
        logits = self.lm.feed(tokens)
        # A feed of a few tokens costs about one token's step (a small model's step is per-call
        # overhead and weight reads); a long catch-up (the prompt) is a one-off, not a draft cost.
        if len(tokens) <= self.STEP_LIKE:
            self.feed_seconds.append(time.perf_counter() - start)
        self._ids.extend(tokens)
        if self.vocab_limit is not None:
            if self.head_vocab is not None:
                logits = logits.masked_fill(~self._keep, float("-inf"))
            elif logits.shape[0] > self.vocab_limit:
                logits = logits[: self.vocab_limit]
        return logits

    def _sync(self, ids: list[int]) -> torch.Tensor:
        if self._peeked is not None and self._ids == ids:
            return self._peeked  # peek already read exactly these ids
        self._peeked = None
        common = common_prefix_len(self._ids, ids[:-1])  # always re-feed at least the last token
        window = self.context
        if window is not None and (common < self._base or len(ids) - common > window
                                   or len(ids) - self._base > self.REWINDOW * window):
            # a new context, a catch-up longer than the window, or a cache grown past its bound:
            # start over on the last `window` tokens (RoPE attends by relative position, so the
            # cache may start anywhere)
            self.lm.crop(0)
            self._base = max(0, len(ids) - window)
            self._ids = list(ids[: self._base])
            return self._feed(ids[self._base:])
        self.lm.crop(common - self._base)
        del self._ids[common:]
        return self._feed(ids[common:])

    def offers(self, ids: list[int]) -> list[Offer]:
        return [Offer(self.name, 0, UNBOUNDED, needs_peek=True)]

    def peek(self, ids: list[int]) -> Offer:
        """Reads the context up to `ids` and rates the first draft: its probability is the offer's
        confidence bucket. Costs one draft step, which `propose` then does not repeat."""
        self.feed_seconds = []
        logits = self._sync(ids)
        self._peeked = logits
        p = float(torch.softmax(logits, -1).max())
        return Offer(self.name, confidence_bucket(p), UNBOUNDED)

    def _to_ids(self, rows: torch.Tensor) -> torch.Tensor:
        """Head rows -> token ids (the identity for a full-vocabulary head)."""
        return rows if self.head_vocab is None else self.head_vocab[rows]

    def propose(self, ids: list[int], k: int, sampling: SamplingParams, gen: torch.Generator | None) -> Draft:
        start = time.perf_counter()
        if self._peeked is None or self._ids != ids:
            self.feed_seconds = []
        if k <= 0:
            return Draft(tokens=[], proposer=self.name)
        logits = self._sync(ids)
        self._peeked = None
        grammar = self._grammar_at(ids, sampling)
        tokens: list[int] = []
        supports, sprobs = [], []
        bucket = 0
        for i in range(k):
            if sampling.adjusts_logits:
                logits = self._adjusted(logits, sampling, ids, tokens)
            if grammar is not None:
                logits = grammar.masked(logits, self.head_vocab)
                if logits is None:  # the grammar is complete, or allows nothing this head can write
                    break
            p_top = float(torch.softmax(logits, -1).max())
            if i == 0:
                bucket = confidence_bucket(p_top)
            elif p_top < self.stop_below:
                break
            if sampling.greedy:
                tok = int(self._to_ids(argmax_rows(logits)))
            else:
                probs = torch.softmax(logits / sampling.temperature, dim=-1)  # [head_rows]
                top = torch.topk(probs, min(self.draft_top_k, probs.shape[0]))
                q = top.values / top.values.sum()  # [s]
                noise = exp_noise(q.shape[0], gen)  # [s]
                support = self._to_ids(top.indices)  # [s] token ids
                tok = int(support[int((q / noise).argmax())])
                supports.append(support)
                sprobs.append(q)
            tokens.append(tok)
            if grammar is not None and not grammar.accept(tok):
                break
            if i + 1 < k:
                logits = self._feed([tok])
        if grammar is not None:
            grammar.rewind()
        draft = Draft(tokens=tokens, proposer=self.name, bucket=bucket, seconds=time.perf_counter() - start)
        if supports:
            draft.support = torch.stack(supports).long()  # [k, s]
            draft.support_probs = torch.stack(sprobs).float()  # [k, s]
        return draft

    def _grammar_at(self, ids: list[int], sampling: SamplingParams) -> "_DraftGrammar | None":
        """The grammar state after `ids`, or None (no grammar; or it could not follow this sequence).

        The grammar covers generated tokens, and a sequence's first propose comes right after its
        context, so that call fixes where generation starts; later calls bring the tokens committed
        since (and, drafting ahead, the anchor's drafts), which the matcher follows, rolling back to
        the common prefix first. Tokens it cannot follow mean another generation began (a new turn
        on a reused proposer): the next call starts over there. Wrong guesses cost speed only."""
        if sampling.grammar is None:
            self._grammar = None
            return None
        g = self._grammar
        if (g is None or g.broken or g.grammar != sampling.grammar or len(ids) < g.start
                or (g.start and ids[g.start - 1] != g.anchor)):
            stop = sorted(sampling.stop_ids(self.loaded.eos_token_ids))
            vocab = self.vocab_limit or self.loaded.vocab_size
            try:
                g = self._grammar = _DraftGrammar(sampling.grammar, self.loaded.tokenizer, vocab, stop,
                                                  start=len(ids), anchor=ids[-1] if ids else -1)
            except Exception:  # a grammar the target compiled is not ours to refuse: draft without it
                self._grammar = None
                return None
        return g if g.follow(ids[g.start :]) else None

    def per_token_seconds(self) -> float | None:
        """Cost of one drafted token in the last propose: its short feeds (catching up on a
        longer stretch of context is a one-off, not a per-token cost)."""
        return sum(self.feed_seconds) / len(self.feed_seconds) if self.feed_seconds else None


class _DraftGrammar:
    """A draft model's own grammar matcher, at the generated tokens of its sequence."""

    def __init__(self, grammar, tokenizer, vocab_size: int, stop_ids: list[int], *, start: int, anchor: int):
        from tandem.engine.speculation.grammar import Constraint

        self.grammar, self.start, self.anchor = grammar, start, anchor
        self.constraint = Constraint(grammar, tokenizer, vocab_size, stop_ids)
        # one row of the matcher's bitmask, filled per drafted position; its bit order, for unpacking
        self._bitmask = self.constraint._xgr.allocate_token_bitmask(1, vocab_size)  # [1, words] int32
        self._bit = torch.arange(32, dtype=torch.int32)  # [32]
        self.fed: list[int] = []  # generated tokens the matcher has accepted
        self.walked = 0  # drafts accepted on top of them in the current propose
        self.broken = False  # it refused a committed token: this sequence is not the one it knows

    def follow(self, generated: list[int]) -> bool:
        if self.broken:
            return False
        m = self.constraint.matcher
        common = 0
        while common < min(len(self.fed), len(generated)) and self.fed[common] == generated[common]:
            common += 1
        if len(self.fed) > common:
            m.rollback(len(self.fed) - common)
            del self.fed[common:]
        for tok in generated[common:]:
            if m.is_terminated() or not m.accept_token(tok):
                self.broken = True
                return False
            self.fed.append(tok)
        return True

    def masked(self, logits: torch.Tensor, head_vocab: torch.Tensor | None) -> torch.Tensor | None:
        """`logits # [head_rows]` with the rows the grammar refuses next at -inf; None when it allows
        none of them (or is complete)."""
        m = self.constraint.matcher
        if m.is_terminated():
            return None
        m.fill_next_token_bitmask(self._bitmask, 0)
        bits = ((self._bitmask[0].unsqueeze(-1) >> self._bit) & 1).bool().flatten()  # [words*32]
        allowed = bits[head_vocab] if head_vocab is not None else bits[: logits.shape[0]]  # [head_rows]
        if allowed.shape[0] < logits.shape[0]:  # head rows past the target's vocabulary: never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(logits.shape[0] - allowed.shape[0])])
        if not bool(allowed.any()):
            return None
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, tok: int) -> bool:
        """Walk the matcher through a draft; False when nothing may follow it (it completed the grammar)."""
        m = self.constraint.matcher
        if not m.accept_token(tok):  # cannot happen after masking; stop drafting if it does
            return False
        self.walked += 1
        return not m.is_terminated()

    def rewind(self) -> None:
        """Back to the committed tokens after a propose."""
        if self.walked:
            self.constraint.matcher.rollback(self.walked)
        self.walked = 0


class HybridProposer(Proposer):
    """Prompt lookup, suffix decoding (when given) and a draft model, chosen per step.

    Each step both make an offer: prompt lookup's, when the context matches, carries its match
    length; the model's confidence (the probability of its first draft) costs a draft step to learn,
    so the model offers a look, taken only where the confidences it has shown so far make it pay.
    The controller values each offer by the expected committed tokens per second it buys (measured
    acceptance for that proposer and confidence, measured draft cost) and the better one drafts. A
    long match inside a copied schema goes to prompt lookup (from LONG_MATCH on without even asking
    the model); free prose goes to the model. Stats are kept per proposer, so the choice and its
    outcome show. With suffix decoding (tandem.engine.speculation.suffix), it offers in prompt lookup's place,
    for free: its index holds the same matches in the session's tokens, and reaches into earlier
    responses of other sessions; its bucket is its own.
    """

    name = "hybrid"
    costly = True

    def __init__(self, ngram: NgramProposer, model: DraftModelProposer, *, min_lookup_match: int = 3,
                 suffix: Proposer | None = None):
        self.ngram, self.model, self.suffix = ngram, model, suffix
        self.min_lookup_match = min_lookup_match
        self.by_name: dict[str, Proposer] = {ngram.name: ngram, model.name: model}
        if suffix is not None:
            self.by_name[suffix.name] = suffix
        self._last_source = model.name

    LONG_MATCH = 8  # a context match this long wins outright: the model is not even asked

    def offers(self, ids: list[int]) -> list[Offer]:
        # With suffix decoding, prompt lookup makes no offer of its own: the suffix index holds the
        # same matches in the session's tokens (plus the store's). Two proposers over the same
        # evidence, each priced by its own acceptance counts, let the choice go to whichever count
        # is luckier: measured, suffix drafts inside the hybrid were accepted 22-29% of the time
        # on MT-Bench against 47% alone, 31% against 41% on BFCL (docs/benchmarks.md, "The hybrid:
        # suffix decoding in prompt lookup's place").
        free = self.suffix.peek(ids) if self.suffix is not None else self.ngram.peek(ids)
        look = Offer(self.model.name, 0, UNBOUNDED, needs_peek=True)
        if free.available <= 0:
            return [look]
        # a long match in the session's own tokens wins outright (a match in suffix decoding's
        # store, from other sessions, still lets the model have its look)
        own = self.suffix is None or free.bucket < STORE_BUCKET
        if own and free.bucket >= self.LONG_MATCH:
            return [free]
        return [free, look]

    def rate(self, source: str, ids: list[int]) -> Offer:
        return self.by_name[source].peek(ids)

    def peek(self, ids: list[int]) -> Offer:
        """Without measurements (a remote drafter drafting ahead): suffix decoding, then prompt
        lookup, when its match is at least `min_lookup_match` tokens long, else the model."""
        if self.suffix is not None:
            found = self.suffix.peek(ids)
            if found.available > 0 and found.bucket % 16 >= self.min_lookup_match:
                return found
        lookup = self.ngram.peek(ids)
        if lookup.available > 0 and lookup.bucket >= self.min_lookup_match:
            return lookup
        return Offer(self.model.name, 0, UNBOUNDED)

    def propose(self, ids: list[int], k: int, sampling: SamplingParams, gen: torch.Generator | None) -> Draft:
        return self.propose_from(self.peek(ids).proposer, ids, k, sampling, gen)

    def propose_from(self, source: str, ids: list[int], k: int, sampling: SamplingParams,
                     gen: torch.Generator | None) -> Draft:
        self._last_source = source
        return self.by_name[source].propose(ids, k, sampling, gen)

    def per_token_seconds(self) -> float | None:
        return self.by_name[self._last_source].per_token_seconds()

    def on_commit(self, ids: list[int], appended: list[int], next_k: int) -> None:
        for p in self.by_name.values():
            p.on_commit(ids, appended, next_k)

    def begin(self, context_len: int) -> None:
        self.model.begin(context_len)
        if self.suffix is not None:
            self.suffix.begin(context_len)

    def finish(self, ids: list[int]) -> None:
        if self.suffix is not None:
            self.suffix.finish(ids)

    def allow_trees(self, ok: bool) -> None:
        if self.suffix is not None:
            self.suffix.allow_trees(ok)

    def reset(self) -> None:
        for p in self.by_name.values():
            p.reset()


@dataclass
class ProposerFactory:
    """Builds one proposer per sequence (proposers keep per-sequence state)."""

    spec: SpecConfig
    draft_model: LoadedModel | None = None
    target_vocab: int | None = None
    draft_int8: bool = True  # draft model steps with int8 weights on a CPU
    # Suffix decoding's cross-session store (finished responses of earlier generations of this
    # factory); None: suffix drafts from the sequence's own tokens only.
    suffix_store: object | None = None
    hybrid_suffix: bool = True  # the hybrid offers suffix decoding too (False: prompt lookup and the model)
    suffix_trees: bool = True  # suffix decoding drafts token trees (where the generation can verify them)

    def build(self, spec: SpecConfig | None = None) -> Proposer | None:
        spec = spec or self.spec
        if spec.strategy.value == "none":
            return None
        if spec.strategy.value == "ngram":
            return NgramProposer(spec.ngram_min, spec.ngram_max)
        if spec.strategy.value == "suffix":
            from tandem.engine.speculation.suffix import SuffixProposer

            return SuffixProposer(self.suffix_store, trees=self.suffix_trees)
        if self.draft_model is None:
            raise ValueError(
                f"draft strategy {spec.strategy.value!r} needs a draft model (--draft-model PATH, or "
                "`tandem distill` to make one for the default target)"
            )
        # fixed block lengths (adaptive off) mean exactly that: no early stop either
        model = DraftModelProposer(self.draft_model, draft_top_k=spec.draft_top_k, vocab_limit=self.target_vocab,
                                   stop_below=None if spec.adaptive else 0.0, int8=self.draft_int8)
        if spec.strategy.value == "hybrid":
            from tandem.engine.speculation.suffix import SuffixProposer

            suffix = SuffixProposer(self.suffix_store, trees=self.suffix_trees) if self.hybrid_suffix else None
            return HybridProposer(NgramProposer(spec.ngram_min, spec.ngram_max), model, suffix=suffix)
        return model
