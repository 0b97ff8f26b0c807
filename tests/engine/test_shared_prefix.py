"""A shared prefix held once (llama.KVPrefix): caches that begin with the same tokens read the first
whole attention runs of them from one storage in place of copies of their own. Every position keeps
the bits it has with a copy, however the sharing came about and whatever the caches do next: the
owner grows or rolls back below what it lent, a sharer lends on, rolls back into its prefix, runs
token trees, or outlives the owner.
"""

from __future__ import annotations

import gc

import pytest
import torch

from conftest import make_tiny_llama
from tandem.engine.model.backends import NativeBackend
from tandem.engine.model.llama import KVCache, NativeLlama
from tandem.engine.native import attend

needs_kernel = pytest.mark.skipif(attend.library() is None, reason="no AVX2/AVX-512 or no C compiler: torch's attention")
SPAN = attend.SPAN


@pytest.fixture(scope="module")
def model() -> NativeLlama:
    return NativeLlama(make_tiny_llama(seed=3, num_layers=2, max_positions=4096))


def _ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, 60, (n,), generator=gen).tolist()


def _fill(m: NativeLlama, cache: KVCache, ids: list[int], piece: int = 200) -> None:
    for at in range(0, len(ids), piece):
        m.forward(ids[at : at + piece], cache, all_logits=False)


def _filled(m: NativeLlama, ids: list[int]) -> KVCache:
    cache = m.new_cache()
    _fill(m, cache, ids)
    return cache


def _alone(m: NativeLlama, ids: list[int], tail: list[int]) -> torch.Tensor:
    return m.forward(tail, _filled(m, ids))


def _owner_and_sharer(m: NativeLlama, tools: list[int], length: int | None = None) -> tuple[KVCache, KVCache]:
    """A cache that computed `tools` and one that takes its first `length` (default all) positions."""
    owner, sharer = _filled(m, tools), m.new_cache()
    NativeBackend.copy_prefix(owner, sharer, len(tools) if length is None else length)
    return owner, sharer


def test_sharers_get_the_bits_of_a_copy(model) -> None:
    """Three sessions of one tool list (600 tokens: two whole runs shared, the rest copied): each
    one's logits equal its context computed alone, and the shared runs are one storage."""
    m = model
    tools = _ids(600, 1)
    owner = m.new_cache()
    _fill(m, owner, tools + _ids(40, 2))
    sharers = []
    for i in range(3):
        c = m.new_cache()
        NativeBackend.copy_prefix(owner if i == 0 else sharers[-1], c, len(tools))
        assert c.off == 2 * SPAN and c.length == len(tools) and c.prefix.k.data_ptr() == owner.k.data_ptr()
        sharers.append(c)
    assert owner.frozen == 2 * SPAN
    for i, c in enumerate(sharers):
        question = _ids(30 + i, 10 + i)
        got = m.forward(question, c)
        assert torch.equal(got, _alone(m, tools, question)), i
        # batched beside the owner and each other, a decode row each
        outs = m.forward_batch([([7], owner), ([8], c)])
        assert torch.equal(outs[1], _alone(m, tools, question + [8])[-1:])


def test_the_owner_grows_and_rolls_back_without_touching_what_it_lent(model) -> None:
    m = model
    tools = _ids(520, 3)
    owner, sharer = _owner_and_sharer(m, tools)  # the owner's cache had 256 slots at first and grew
    lent = owner.k.data_ptr()
    # the owner grows past its storage: the lent slots become its own prefix, not a copy
    _fill(m, owner, _ids(900, 4))
    assert owner.prefix is not None and owner.prefix.k.data_ptr() == lent and owner.frozen == 0
    # the owner rolls back into what it lent and writes other tokens there
    owner.crop_to(300)
    other = _ids(400, 5)
    _fill(m, owner, other)
    question = _ids(25, 6)
    assert torch.equal(m.forward(question, sharer), _alone(m, tools, question))
    assert torch.equal(m.forward(question, owner), _alone(m, tools[:300] + other, question))


def test_a_sharer_rolls_back_into_its_prefix_and_outlives_the_owner(model) -> None:
    m = model
    tools = _ids(800, 7)
    owner, sharer = _owner_and_sharer(m, tools)
    assert sharer.off == 3 * SPAN
    del owner
    gc.collect()  # the prefix's storage lives on in the sharer
    sharer.crop_to(600)  # into the prefix: keeps two whole runs shared, copies the rest out
    assert sharer.off == 2 * SPAN
    tail = _ids(50, 8)
    assert torch.equal(m.forward(tail, sharer), _alone(m, tools[:600], tail))
    sharer.crop_to(100)  # below one run: nothing shared any more
    assert sharer.prefix is None and sharer.off == 0
    assert torch.equal(m.forward(tail, sharer), _alone(m, tools[:100], tail))


def test_token_trees_and_accepted_paths_past_a_shared_prefix(model) -> None:
    m = model
    tools = _ids(512, 9)
    owner, sharer = _owner_and_sharer(m, tools)
    copy = m.new_cache()
    copy.take_prefix(owner, len(tools), share=False)
    assert sharer.off == 2 * SPAN and copy.off == 0
    parents = [-1, 0, 0, 1, 2, 3]
    drafts = [11, 12, 13, 14, 15, 16]
    a = m.forward_batch([(drafts, sharer)], trees=[parents])[0]
    b = m.forward_batch([(drafts, copy)], trees=[parents])[0]
    assert torch.equal(a, b)
    for c in (sharer, copy):
        NativeLlama.keep_path(c, len(tools), [0, 2, 4])
        c.length = len(tools) + 3
    assert torch.equal(m.forward([20, 21], sharer), m.forward([20, 21], copy))


@needs_kernel
def test_no_shared_prefix_in_a_kv_pool(model) -> None:
    """A pool's region is a strided view the kernel cannot read as a prefix: pooled caches copy."""
    m = NativeLlama(make_tiny_llama(seed=3, num_layers=2, max_positions=4096))
    m.size_kv_pool(8192)
    tools = _ids(600, 12)
    owner, sharer = _owner_and_sharer(m, tools)
    assert owner.pool is not None and sharer.pool is not None
    assert sharer.prefix is None and owner.frozen == 0
    tail = _ids(9, 13)
    assert torch.equal(m.forward(tail, sharer), _alone(m, tools, tail))


def test_what_a_cache_holds_of_its_own(model) -> None:
    """NativeBackend.kv_held: the verifier counts a shared prefix once, by the storage it lies in."""
    m = model
    owner, sharer = _owner_and_sharer(m, _ids(700, 14), 650)
    assert NativeBackend.kv_held(owner) == (700, None)
    assert NativeBackend.kv_held(sharer) == (650 - 512, (NativeBackend.own_key(owner), 512))


def test_a_cache_takes_another_prefix_over_what_it_held(model) -> None:
    """A cache that reads a prefix, or lent its own slots, and then takes another sequence's
    positions: it moves to storage of its own where it must (its slots are short, or others read
    them), and neither it nor the caches that read it see anything but their own tokens."""
    m = model
    a, b = _ids(300, 20), _ids(900, 21)
    _, src = _owner_and_sharer(m, b[:300])  # reads 256 of b, then holds 600 more itself
    _fill(m, src, b[300:])
    assert src.off == SPAN
    _, dst = _owner_and_sharer(m, a)  # reads 256 of a
    NativeBackend.copy_prefix(src, dst, 800)  # 256 shared with src's prefix, 544 copied: more than its slots
    assert dst.off == SPAN and dst.prefix.k.data_ptr() == src.prefix.k.data_ptr()
    tail = _ids(7, 22)
    assert torch.equal(m.forward(tail, dst), _alone(m, b[:800], tail))
    lender, reader = _owner_and_sharer(m, a)  # reader reads lender's own slots
    NativeBackend.copy_prefix(src, lender, 100)  # too short to share: the lender copies into new storage
    assert lender.prefix is None and lender.frozen == 0 and reader.prefix.k.data_ptr() != lender.k.data_ptr()
    assert torch.equal(m.forward(tail, lender), _alone(m, b[:100], tail))
    assert torch.equal(m.forward(tail, reader), _alone(m, a, tail))
