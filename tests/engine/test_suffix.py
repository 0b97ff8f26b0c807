"""Suffix decoding's structures against brute force on random sequences (matches, occurrences,
continuation counts, eviction), and the proposer: greedy output with suffix drafts equals the
target alone; the store learns from finished generations; drafts never reach across stores."""

from __future__ import annotations

import random

import pytest

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.engine.scheduler.generate import Engine
from tandem.engine.speculation.suffix import PROMPT_TAIL, SuffixIndex, SuffixProposer, SuffixStore, SuffixStores


def _brute_match(seqs: dict[int, list[int]], firsts: dict[int, int], pattern: list[int], cap: int):
    """Longest suffix of pattern (<= cap) occurring in some sequence with a continuation that
    starts at or after the sequence's first end; and the set of its occurrences."""
    best, where = 0, set()
    for sid, seq in seqs.items():
        for end in range(max(1, firsts[sid]), len(seq)):
            length = 0
            while length < min(cap, len(pattern), end) and seq[end - length - 1] == pattern[-length - 1]:
                length += 1
            if length == 0:
                continue
            if length > best:
                best, where = length, {(sid, end)}
            elif length == best:
                where.add((sid, end))
    return best, where


def _brute_counts(seqs, where, depth: int) -> dict[tuple[int, ...], int]:
    """How many occurrences continue with each path of up to `depth` tokens."""
    counts: dict[tuple[int, ...], int] = {}
    for sid, end in where:
        seq = seqs[sid]
        for d in range(1, depth + 1):
            if end + d > len(seq):
                break
            path = tuple(seq[end:end + d])
            counts[path] = counts.get(path, 0) + 1
    return counts


def _tree_counts(cont, depth: int) -> dict[tuple[int, ...], int]:
    counts = {}

    def walk(node, path, at):
        if at == depth:
            return
        for tok, occ in cont.children(node, at):
            counts[path + (tok,)] = len(occ)
            walk(occ, path + (tok,), at + 1)

    walk(cont.root, (), 0)
    return counts


def _ref_chain(seqs, where, limit: int, min_prob: float) -> tuple[list[int], list[float]]:
    """The most frequent path by plain grouping at every level (ties: the occurrence listed first),
    each step's share of all occurrences; stops below min_prob."""
    node, tokens, probs = list(where), [], []
    for at in range(limit):
        groups: dict[int, list] = {}
        for sid, end in node:
            if end + at < len(seqs[sid]):
                groups.setdefault(seqs[sid][end + at], []).append((sid, end))
        if not groups:
            break
        tok, occ = max(groups.items(), key=lambda kv: len(kv[1]))  # the first of the most frequent
        if len(occ) / len(where) < min_prob:
            break
        tokens.append(tok)
        probs.append(len(occ) / len(where))
        node = occ
    return tokens, probs


def _random_seq(rng: random.Random, n: int, vocab: int) -> list[int]:
    # repetitive enough to have long matches: copy earlier stretches now and then
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.3:
            start = rng.randrange(len(out))
            out.extend(out[start:start + rng.randint(2, 12)])
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


@pytest.mark.parametrize("seed", range(6))
def test_match_occurrences_and_continuations_equal_brute_force(seed) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([3, 8, 40])
    index = SuffixIndex(candidates=None, max_match=12)
    seqs, firsts = {}, {}
    for sid in range(rng.randint(1, 4)):
        seq = _random_seq(rng, rng.randint(5, 120), vocab)
        first = rng.randint(1, 5)
        # added in pieces: the incremental path must equal a whole add
        index.add(sid, seq[:3], first_end=first)
        cut = 3
        while cut < len(seq):
            step = rng.randint(1, 9)
            index.extend(sid, seq[cut:cut + step])
            cut += step
        seqs[sid], firsts[sid] = seq, first
    for _ in range(40):
        pattern = _random_seq(rng, rng.randint(1, 30), vocab)
        if rng.random() < 0.5:  # a pattern ending in a piece of a sequence
            seq = seqs[rng.choice(list(seqs))]
            a = rng.randrange(len(seq))
            pattern = pattern + seq[max(0, a - rng.randint(1, 20)):a + 1]
        got = index.match(pattern)
        length, where = _brute_match(seqs, firsts, pattern, 12)
        assert got.length == length
        assert set(got.where) == where and len(got.where) == len(where)
        if length:
            cont = index.continuations(got.where, 6)
            assert _tree_counts(cont, 6) == _brute_counts(seqs, where, 6)
            for min_prob in (0.0, 0.1, 0.5):  # the chain, with its one-occurrence shortcut
                assert cont.best_chain(6, min_prob) == _ref_chain(seqs, got.where, 6, min_prob)


def test_a_bounded_index_keeps_the_most_recent_occurrences_of_a_gram() -> None:
    index = SuffixIndex(candidates=3, gram_sizes=(1,), max_match=4)
    seq = [7, 1, 7, 2, 7, 3, 7, 4, 7]
    index.add(0, seq)
    m = index.match([7])
    assert m.length == 1 and m.where == [(0, 7), (0, 5), (0, 3)]  # most recent first, the oldest dropped


@pytest.mark.parametrize("seed", range(4))
def test_eviction_leaves_what_a_fresh_store_of_the_rest_holds(seed) -> None:
    rng = random.Random(100 + seed)
    store = SuffixStore(max_tokens=300, candidates=None)
    kept: list[tuple[list[int], list[int]]] = []
    for _ in range(25):
        prompt, response = _random_seq(rng, rng.randint(0, 50), 6), _random_seq(rng, rng.randint(4, 90), 6)
        assert store.add(prompt, response)
        kept.append((prompt, response))
        assert store.tokens <= 300 or store.responses == 1
    assert store.evicted > 0 and store.responses < 25
    fresh = SuffixStore(max_tokens=10**9, candidates=None)
    for prompt, response in kept[-store.responses:]:
        fresh.add(prompt, response)
    assert list(store.index.seqs.values()) == list(fresh.index.seqs.values())
    for _ in range(60):
        pattern = _random_seq(rng, rng.randint(1, 20), 6)
        a, b = store.index.match(pattern), fresh.index.match(pattern)
        assert a.length == b.length
        # same occurrences, up to the sequence ids each store gave
        ids_a = {sid: i for i, sid in enumerate(store.index.seqs)}
        ids_b = {sid: i for i, sid in enumerate(fresh.index.seqs)}
        assert sorted((ids_a[s], e) for s, e in a.where) == sorted((ids_b[s], e) for s, e in b.where)
    # every gram list is clean: nothing points at an evicted sequence
    for grams in store.index._grams.values():
        for held in grams.values():
            codes = [held] if isinstance(held, int) else held
            assert codes and all(code >> 32 in store.index.seqs for code in codes)


def test_the_store_matches_a_response_from_its_prompt_tail_and_never_proposes_the_prompt() -> None:
    store = SuffixStore()
    prompt, response = list(range(100, 140)), [5, 6, 7, 8, 9, 10]
    store.add(prompt, response)
    m = store.index.match([1, 2, *prompt[-10:]])
    assert m.length == 10
    tokens, probs = store.index.continuations(m.where, 16).best_chain(16, 0.1)
    assert tokens == response and probs == [1.0] * 6
    # a match inside the prompt tail continues into the prompt: not indexed, nothing proposed
    assert store.index.match(prompt[-PROMPT_TAIL:-20]).length == 0


def test_the_chain_follows_the_most_frequent_continuation_and_stops_below_min_prob() -> None:
    index = SuffixIndex(candidates=None)
    # after [1, 2]: 3 times "3 4", once "3 9", once "5"
    index.add(0, [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 9, 0, 1, 2, 5, 0, 1, 2, 3, 4])
    m = index.match([8, 1, 2])
    assert m.length == 2 and len(m.where) == 5
    tokens, probs = index.continuations(m.where, 8).best_chain(8, 0.1)
    assert tokens[:2] == [3, 4] and probs[:2] == [4 / 5, 3 / 5]
    tokens, _ = index.continuations(m.where, 8).best_chain(8, 0.7)
    assert tokens == [3]  # "3 4" is followed by 3/5 < 0.7 of the occurrences


def test_stores_are_per_model_and_scope() -> None:
    stores = SuffixStores(max_tokens=1000, max_stores=2)
    a, b = stores.get("m", "tenant-a"), stores.get("m", "tenant-b")
    assert a is not b and stores.get("m", "tenant-a") is a and stores.get("other", "tenant-a") is not a
    assert len(stores._stores) == 2  # the least recently used went


def _engine(tiny_loaded) -> Engine:
    return Engine(tiny_loaded, spec=SpecConfig(strategy=DraftStrategy.suffix))


PROMPTS = ["the answer is the answer is the answer is", "def return if else for while def return if",
           "one two three one two three one two"]


@pytest.mark.parametrize("max_new", [40, 120])
def test_greedy_output_with_suffix_drafts_equals_the_target_alone(tiny_loaded, max_new) -> None:
    """Cold and warm (the store fed by the earlier prompts' finished responses, and by a first
    answer to the same prompt): every output equals plain decoding's, token for token."""
    tok = tiny_loaded.tokenizer
    engine = _engine(tiny_loaded)
    store = SuffixStore()
    plain = SpecConfig(strategy=DraftStrategy.none)
    sampling = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    drafted = 0
    for round_ in range(2):
        for text in PROMPTS:
            ids = tok(text)["input_ids"]
            want = engine.generate(ids, sampling, plain).token_ids
            gen = engine.start(ids, sampling, proposer=SuffixProposer(store))
            for _ in gen:
                pass
            got = gen.result()
            assert got.token_ids == want, f"round {round_}: {text!r}"
            drafted += got.stats.drafted
    assert store.responses == 2 * len(PROMPTS)
    assert drafted > 0


def test_a_prompt_answered_twice_is_drafted_from_the_first_answer(tiny_loaded) -> None:
    """Warm: the second answer to the same prompt drafts from the store and commits several
    tokens per step; with an empty store (cold) the same prompt takes more than twice the steps."""
    tok = tiny_loaded.tokenizer
    engine = _engine(tiny_loaded)
    ids = tok("cat dog bird fish cow")["input_ids"]  # no repeats: the session alone has nothing to copy
    sampling = SamplingParams(max_new_tokens=48, ignore_eos=True)
    store = SuffixStore()
    fixed = SpecConfig(strategy=DraftStrategy.suffix, adaptive=False, max_draft_tokens=8)  # no timing in it
    cold = engine.start(ids, sampling, fixed, proposer=SuffixProposer(store))
    first = [t for step in cold for t in step.tokens]
    warm = engine.start(ids, sampling, fixed, proposer=SuffixProposer(store))
    second = [t for step in warm for t in step.tokens]
    assert second == first
    w, c = warm.result().stats, cold.result().stats
    assert store.responses == 2
    assert w.by_proposer["suffix"]["accepted"] >= 0.7 * len(second)  # most of it came from the first answer
    assert w.steps < c.steps / 2


def test_hash_collisions_cost_a_comparison_never_a_wrong_match(monkeypatch) -> None:
    """Grams are keyed by their hash: with every gram on one key, matches still equal brute force."""
    import tandem.engine.speculation.suffix as suffix_mod

    monkeypatch.setattr(suffix_mod, "hash", lambda gram: 7, raising=False)
    rng = random.Random(9)
    index = SuffixIndex(candidates=None, max_match=12)
    seq = _random_seq(rng, 150, 5)
    index.add(0, seq)
    for _ in range(40):
        pattern = _random_seq(rng, rng.randint(1, 16), 5)
        got, (length, where) = index.match(pattern), _brute_match({0: seq}, {0: 1}, pattern, 12)
        assert (got.length, set(got.where)) == (length, where)


def test_stores_share_one_token_budget_the_others_give_first() -> None:
    stores = SuffixStores(max_tokens=200)
    a, b = stores.get("m", "a"), stores.get("m", "b")
    for _ in range(3):
        a.add([1, 2], list(range(10, 60)))  # 52 tokens each
    stores.get("m", "a")  # a is now the most recently used
    b.add([1, 2], list(range(100, 150)))
    b.add([1, 2], list(range(200, 250)))
    assert a.tokens + b.tokens <= 200
    assert b.responses == 2 and a.responses == 1 and a.evicted == 2  # the other store gives way first


def test_the_store_keeps_the_answer_as_it_ended_with_its_stop_token(tiny_loaded) -> None:
    """A block may commit tokens past the stop id; the store keeps prompt tail, output and the
    stop id, nothing after it."""
    tok = tiny_loaded.tokenizer
    engine = _engine(tiny_loaded)
    ids = tok("one two three one two three one two")["input_ids"]
    free = engine.generate(ids, SamplingParams(max_new_tokens=30, ignore_eos=True),
                           SpecConfig(strategy=DraftStrategy.none)).token_ids
    cut = next(i for i, t in enumerate(free) if i >= 5 and free.index(t) == i)  # a token first seen late
    stop = free[cut]
    store = SuffixStore()
    sampling = SamplingParams(max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    gen = engine.start(ids, sampling, SpecConfig(strategy=DraftStrategy.suffix, adaptive=False, max_draft_tokens=8),
                       proposer=SuffixProposer(store))
    out = [t for step in gen for t in step.tokens]
    assert out == free[:cut]
    (kept,) = store.index.seqs.values()
    assert kept == (ids[-PROMPT_TAIL:] + free[:cut] + [stop])


def test_the_hybrid_offers_suffix_decoding_in_prompt_lookups_place(tiny_loaded) -> None:
    """With suffix decoding in the hybrid, prompt lookup makes no offer of its own (the suffix index
    holds the same matches; two proposers over the same evidence let the choice follow whichever
    acceptance count is luckier). A long match in the session's own tokens wins outright; one in
    the store leaves the model its look. Without suffix decoding, prompt lookup offers as before."""
    from tandem.engine.speculation.draft import STORE_BUCKET
    from tandem.engine.speculation.proposers import DraftModelProposer, HybridProposer, NgramProposer

    model = DraftModelProposer(tiny_loaded)
    text = list(range(100, 130))
    ids = text + [7, 8] + text[:12]  # the last 12 tokens occurred before: a 12-token own match
    store = SuffixStore()
    hybrid = HybridProposer(NgramProposer(), model, suffix=SuffixProposer(store))
    offers = hybrid.offers(ids)
    assert [o.proposer for o in offers] == ["suffix"] and offers[0].bucket == 12
    short = [1, 2, 3, 9, 1, 2]  # a 2-token own match: the model may still look
    assert [o.proposer for o in hybrid.offers(short)] == ["suffix", "model"]
    # another session's answer in the store, matched over 10 tokens: the model still looks
    answer = list(range(300, 340))
    store.add([5, 6], answer)
    fresh = HybridProposer(NgramProposer(), model, suffix=SuffixProposer(store))
    offers = fresh.offers([9, 9] + answer[:10])
    assert [o.proposer for o in offers] == ["suffix", "model"] and offers[0].bucket == STORE_BUCKET + 10
    assert [o.proposer for o in fresh.offers([400, 401])] == ["model"]  # no match anywhere
    # without suffix decoding: prompt lookup's offer, a long match winning outright at any length
    plain = HybridProposer(NgramProposer(), model)
    offers = plain.offers(text + [7, 8] + text[:20])
    assert [o.proposer for o in offers] == ["ngram"] and offers[0].bucket == 20 > STORE_BUCKET
    assert [o.proposer for o in plain.offers(short)] == ["ngram", "model"]
