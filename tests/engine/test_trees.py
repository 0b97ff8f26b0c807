"""Token-tree drafts (#17): suffix decoding's best-first trees, the native forward over a tree
block, and greedy output through trees equal to the target alone."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.engine.model.llama import NativeLlama
from tandem.engine.scheduler.generate import Engine
from tandem.engine.scheduler.runner import Sequence, TargetRunner
from tandem.engine.speculation.draft import Draft, check_tree
from tandem.engine.speculation.suffix import SuffixIndex, SuffixProposer, SuffixStore
from test_suffix import _brute_counts as _brute_paths  # every continuation prefix after the occurrences


@pytest.mark.parametrize("seed", range(6))
def test_best_tree_is_the_likeliest_tree_read_from_the_sequences(seed) -> None:
    """Against brute force on random sequences: each node's probability is its path's share of the
    occurrences, nodes come best first (so every prefix is a tree), none below min_prob, the first
    path is best_chain's, and no path left out is likelier than the last node taken."""
    rng = random.Random(seed)
    seq = [rng.randrange(4) for _ in range(300)]
    index = SuffixIndex(candidates=None)
    index.add(0, seq)
    m = index.match(seq[-3:] if seed % 2 else [seq[-1]])
    assert m.length
    cont = index.continuations(m.where, 6)
    nodes, depth, min_prob = 5 + seed, 4, 0.05
    tokens, parents, probs = cont.best_tree(nodes, depth, min_prob)
    assert check_tree(tokens, parents) is None and 0 < len(tokens) <= nodes
    counts = _brute_paths(index.seqs, m.where, depth)
    total = len(m.where)
    paths = []
    for i, (t, p) in enumerate(zip(tokens, parents)):
        paths.append((paths[p] if p >= 0 else ()) + (t,))
        assert probs[i] == counts[paths[i]] / total and probs[i] >= min_prob
    assert probs == sorted(probs, reverse=True)
    if len(tokens) == nodes:  # full: nothing left out beats the last node in
        taken = set(paths)
        frontier = [c / total for path, c in counts.items() if path not in taken and path[:-1] in taken | {()}]
        assert all(p <= probs[-1] for p in frontier)
    chain, _ = cont.best_chain(depth, min_prob)
    draft = Draft(tokens=tokens, proposer="suffix", parents=parents)
    assert draft.as_chain().tokens == chain[: len(draft.as_chain().tokens)]


def _tree_draft(runner: TargetRunner, seq: Sequence, rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    vocab = runner.vocab_size
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    tokens, used = [], set()
    for p in parents:
        t = rng.randrange(vocab)
        while (p, t) in used:
            t = rng.randrange(vocab)
        used.add((p, t))
        tokens.append(t)
    return tokens, parents


@pytest.mark.parametrize("context", [12, 300])
def test_a_tree_forward_gives_every_node_its_paths_logits(tiny_loaded, context) -> None:
    """Each node's logits equal a chain forward of the path that leads to it (within float
    rounding: the attention sums the same keys in another order), and after keeping a path the
    cache continues exactly as if that path had been verified as a chain."""
    runner = TargetRunner(tiny_loaded)
    assert isinstance(runner.backend.impl, NativeLlama) and runner.backend.trees
    rng = random.Random(context)
    ids = [rng.randrange(runner.vocab_size) for _ in range(context)]
    tree_seq = Sequence(runner)
    tree_seq.set_context(ids)
    tokens, parents = _tree_draft(runner, tree_seq, rng, 9)
    logits = tree_seq.forward_tree(tokens, parents)  # [10, vocab]
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [i])
    for i, path in enumerate(paths):
        chain = Sequence(runner)
        chain.set_context(ids)
        want = chain.forward_block([tokens[j] for j in path])[-1]
        torch.testing.assert_close(logits[i + 1], want, rtol=1e-4, atol=1e-4)
    # keep the deepest path plus a bonus token; the next step must match a chain's next step
    deepest = max(paths, key=len)
    committed = [tokens[j] for j in deepest] + [7]
    tree_seq.commit_tree(committed, deepest)
    chain = Sequence(runner)
    chain.set_context(ids)
    chain.forward_block(committed[:-1])
    chain.commit(committed)
    assert tree_seq.ids == chain.ids and tree_seq.cached_len == chain.cached_len
    torch.testing.assert_close(tree_seq.forward_block([3, 4]), chain.forward_block([3, 4]), rtol=1e-4, atol=1e-4)


def _branchy_store(engine: Engine, prompts: list[list[int]], max_new: int) -> SuffixStore:
    """Two answers to each prompt, the greedy one and one that forks from it a third of the way in
    (a forced token, then greedy again): at the fork the store's continuations split evenly, so
    suffix decoding drafts a tree with both branches there."""
    store = SuffixStore()
    none = SpecConfig(strategy=DraftStrategy.none)
    for ids in prompts:
        plain = engine.generate(ids, SamplingParams(max_new_tokens=max_new, ignore_eos=True), none).token_ids
        fork = len(plain) // 3
        forced = plain[:fork] + [5 if plain[fork] != 5 else 6]
        rest = engine.generate(ids + forced, SamplingParams(max_new_tokens=max_new - fork, ignore_eos=True),
                               none).token_ids
        store.add(ids, forced + rest)
        store.add(ids, plain)
    return store


# trees run where the forward is not batch-invariant: the measured plan (conftest.measured_gemm)
pytestmark = pytest.mark.usefixtures("measured_gemm")

PROMPTS = ["the answer is the answer is the answer is", "def return if else for while def return if",
           "cat dog bird fish cow"]


@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_output_through_trees_equals_the_target_alone(tiny_loaded, adaptive, monkeypatch) -> None:
    """Cold and with a store whose answers fork: every output equals plain decoding's token for
    token, and trees with branches were verified (counted at the real forward)."""
    tok = tiny_loaded.tokenizer
    engine = Engine(tiny_loaded)
    prompts = [tok(t)["input_ids"] for t in PROMPTS]
    store = _branchy_store(engine, prompts, 60)
    calls = []
    real = Sequence.tree_rows  # every token tree a step verifies, in process or in the step loop
    monkeypatch.setattr(Sequence, "tree_rows", staticmethod(lambda p: calls.append(len(p)) or real(p)))
    sampling = SamplingParams(max_new_tokens=60, ignore_eos=True)
    spec = SpecConfig(strategy=DraftStrategy.suffix, adaptive=adaptive, max_draft_tokens=12)
    accepted = tree_steps = 0
    for ids in prompts:
        want = engine.generate(ids, sampling, SpecConfig(strategy=DraftStrategy.none)).token_ids
        for s in (None, store):
            gen = engine.start(ids, sampling, spec, proposer=SuffixProposer(s, trees=True))
            for _ in gen:
                pass
            res = gen.result()
            assert res.token_ids == want, (PROMPTS[prompts.index(ids)], s is not None)
            accepted += res.stats.accepted
            tree_steps += res.stats.tree_steps
            assert res.stats.tree_off_path <= res.stats.tree_steps
    assert accepted > 0 and tree_steps == len(calls)
    if not adaptive:  # fixed blocks of 12: the fork lies in one block of every warm run
        assert len(calls) >= len(prompts)


def test_trees_fall_back_to_chains_where_drafts_are_needed_in_order(tiny_loaded, monkeypatch) -> None:
    """Penalties (and likewise grammars and logprobs) see drafts position by position: those
    generations get chains from a tree proposer, and their output is still the target's."""
    tok = tiny_loaded.tokenizer
    engine = Engine(tiny_loaded)
    ids = tok("cat dog bird fish cow")["input_ids"]
    store = _branchy_store(engine, [ids], 40)
    calls = []
    real = Sequence.tree_rows  # every token tree a step verifies, in process or in the step loop
    monkeypatch.setattr(Sequence, "tree_rows", staticmethod(lambda p: calls.append(len(p)) or real(p)))
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True, repetition_penalty=1.3)
    want = engine.generate(ids, sampling, SpecConfig(strategy=DraftStrategy.none)).token_ids
    gen = engine.start(ids, sampling, SpecConfig(strategy=DraftStrategy.suffix, adaptive=False),
                       proposer=SuffixProposer(store, trees=True))
    for _ in gen:
        pass
    assert gen.result().token_ids == want and gen.result().stats.drafted > 0
    assert not gen.trees and calls == []


def test_the_transformers_backend_verifies_chains(tiny_loaded) -> None:
    runner = TargetRunner(tiny_loaded, backend="transformers")
    assert not runner.trees_ok
    with pytest.raises(ValueError, match="no token trees"):
        runner.backend.forward(runner.backend.new_cache(), [1, 2], True, tree=[-1, 0])
