"""The KV pool (tandem.engine.model.llama.KVPool) and the pooled attention of a batched forward.

On a GPU every sequence's cache is a region of one pool, so a forward writes and reads the KV of
all its blocks with a fixed number of calls a layer. The same code runs on a CPU when a pool is
asked for, which is how it is tested here: the allocator against a brute-force model of the slots,
and pooled forwards against the per-sequence path on ragged batches (prefill pieces, chains, token
trees, growth, rollback, a pool that runs out).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from conftest import count_pooled_attention, make_tiny_llama
from tandem.engine.model.llama import POOLED_MAX_ROWS, KVPool, NativeLlama


def _owned(regions: dict[int, int]) -> set[int]:
    return {s for start, n in regions.items() for s in range(start, start + n)}


@pytest.mark.parametrize("seed", range(5))
def test_the_allocator_hands_out_disjoint_regions_and_takes_them_back(seed) -> None:
    """Random allocations and releases against a model of the slots: a region is never handed out
    twice, the free list is exactly the slots nobody owns, merged, and an allocation fails only when
    no free run is long enough."""
    rng = random.Random(seed)
    slots = 500
    pool = KVPool(1, 1, 1, torch.float32, "cpu", slots)
    owned: dict[int, int] = {}  # start -> length
    for _ in range(400):
        if owned and rng.random() < 0.45:
            start = rng.choice(sorted(owned))
            pool.release(start, owned.pop(start))
        else:
            n = rng.choice([1, 7, 32, 64, 200])
            start = pool.alloc(n)
            taken = _owned(owned)
            free = [s for s in range(slots) if s not in taken]
            runs, run = [], 0
            for s in range(slots):
                run = run + 1 if s not in taken else 0
                runs.append(run)
            if start is None:
                assert max(runs) < n, f"refused {n} slots with a free run of {max(runs)}"
                continue
            got = set(range(start, start + n))
            assert got <= set(free), "a region overlaps one already handed out"
            owned[start] = n
        regions = pool.regions()
        assert {s for a, n in regions for s in range(a, a + n)} == set(range(slots)) - _owned(owned)
        assert all(a + n < b for (a, n), (b, _) in zip(regions, regions[1:])), "free runs are merged"
    for start, n in owned.items():
        pool.release(start, n)
    assert pool.regions() == [(0, slots)]


def test_a_region_given_back_twice_is_an_error_not_a_corruption() -> None:
    pool = KVPool(1, 1, 1, torch.float32, "cpu", 64)
    start = pool.alloc(16)
    pool.release(start, 16)
    pool.release(start, 16)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.alloc(1)


def test_a_dropped_cache_gives_its_region_back() -> None:
    native = NativeLlama(make_tiny_llama(seed=0, num_layers=1), kv_pool_slots=1024)
    caches = [native.new_cache() for _ in range(3)]
    assert all(c.pool is native.kv_pool for c in caches)
    assert native.kv_pool.free_slots() == 1024 - 3 * 256
    del caches
    gc.collect()
    assert native.kv_pool.regions() == [(0, 1024)]


@pytest.fixture(scope="module")
def pair():
    """The same tiny model with and without a pool (small, so that it runs out mid-test)."""
    model = make_tiny_llama(seed=0, num_layers=2)
    return NativeLlama(model, kv_pool_slots=0), NativeLlama(model, kv_pool_slots=900)


@pytest.mark.parametrize("seed", range(3))
def test_a_pooled_batch_gives_every_block_its_own_logits_and_kv(pair, seed, monkeypatch) -> None:
    """Ragged batches of 5 sequences over 30 steps: prefill pieces longer than POOLED_MAX_ROWS
    (their own attention call), chains, token trees and single tokens, with rollbacks, caches that
    outgrow their region (moved within the pool, or out of it once it is full). Every block's
    logits and every cache's KV equal the per-sequence path's (within float rounding: another
    attention kernel sums in another order)."""
    alone, pooled = pair
    calls = count_pooled_attention(monkeypatch)
    rng = random.Random(seed)
    caches_a = [alone.new_cache(64) for _ in range(5)]
    caches_b = [pooled.new_cache(64) for _ in range(5)]
    moved = False
    for step in range(30):
        blocks_a, blocks_b, need, trees = [], [], [], []
        for ca, cb in zip(caches_a, caches_b):
            n = rng.choice([POOLED_MAX_ROWS + 16, 20] if step < 2 else [1, 2, 5, 9])
            ids = [rng.randrange(200) for _ in range(n)]
            tree = [-1] + [rng.randrange(r) for r in range(1, n)] if 2 < n < 20 and rng.random() < 0.4 else None
            blocks_a.append((ids, ca))
            blocks_b.append((ids, cb))
            need.append(rng.choice([True, True, "last", False]))
            trees.append(tree)
        bases = [c.base if c.pool is not None else None for c in caches_b]
        out_a = alone.forward_batch(blocks_a, need, trees)
        out_b = pooled.forward_batch(blocks_b, need, trees)
        moved |= any(b is not None and (c.pool is None or c.base != b) for b, c in zip(bases, caches_b))
        for la, lb in zip(out_a, out_b):
            assert (la is None) == (lb is None)
            if la is not None:
                torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
        for ca, cb in zip(caches_a, caches_b):
            assert ca.length == cb.length
            torch.testing.assert_close(cb.k[:, :, : cb.length], ca.k[:, :, : ca.length], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cb.v[:, :, : cb.length], ca.v[:, :, : ca.length], rtol=1e-5, atol=1e-5)
            cut = rng.randrange(0, 4)
            ca.crop_to(max(1, ca.length - cut))
            cb.crop_to(max(1, cb.length - cut))
    assert calls, "the pooled path ran"
    assert moved, "a cache outgrew its region during the test"
    assert any(c.pool is None for c in caches_b) and any(c.pool is not None for c in caches_b), \
        "the pool ran out: some caches left it, the rest stayed"


def test_a_pooled_tree_keeps_its_accepted_path(pair) -> None:
    """keep_path on a pooled cache (a strided view of the pool) moves the accepted rows as on a
    cache of its own, and the next forward continues identically."""
    alone, pooled = pair
    ctx = [5 + (7 * i) % 150 for i in range(40)]
    results = []
    for native in (alone, pooled):
        caches = [native.new_cache(), native.new_cache()]
        native.forward_batch([(ctx, caches[0]), (ctx[::-1], caches[1])], [False, False])
        parents = [-1, 0, 0, 1, 2, 2]
        native.forward_batch([([9, 10, 11, 12, 13, 14], caches[0]), ([3], caches[1])], [True, True],
                             [parents, None])
        NativeLlama.keep_path(caches[0], len(ctx), [0, 2, 5])
        caches[0].crop_to(len(ctx) + 3)
        results.append(native.forward_batch([([8, 8], caches[0]), ([4], caches[1])]))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
