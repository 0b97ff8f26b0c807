"""Our CPU attention kernel for every block of the native forward (tandem/engine/native/attend.c) against
its reference, torch's scaled_dot_product_attention with the block's causal mask, and its
invariance: a row's bits do not depend on its block (length, neighbours, threads, instruction set).

It is built with the host's C compiler at first use for AVX-512 or AVX2; where that is impossible
the forward keeps torch's kernel, which is tested too.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from avx2_build import avx2_build

from tandem.engine.native import attend

needs_kernel = pytest.mark.skipif(attend.library() is None, reason="no AVX-512 or AVX2, or no C compiler here: torch's kernel serves")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D], k/v [KV, cap, D] -> [n, H * D]: the block's rows at positions start .. start+n-1
    (`mask` [n, start + n] bool: which keys each row sees; default causal)."""
    n, H, D = q.shape
    KV = k.shape[0]
    if mask is None:
        mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)  # [n, start + n]
    kk = k[:, : start + n].repeat_interleave(H // KV, 0)  # [H, L, D]
    vv = v[:, : start + n].repeat_interleave(H // KV, 0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), kk.double(), vv.double(), attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(n, H * D).float()  # [n, H * D]


@needs_kernel
@pytest.mark.parametrize("H, KV, D", [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 1, 48), (2, 1, 80)])
@pytest.mark.parametrize("start", [0, 1, 15, 63, 64, 300, 1000, 2049])
def test_the_kernel_matches_the_reference(H, KV, D, start) -> None:
    """Head sizes with their own code (64, 128) and the generic one, grouped and plain heads, blocks
    that start at 0, inside a key tile and on its edge, and contexts long enough to be split
    between threads and merged."""
    gen = torch.Generator().manual_seed(H * 1000 + start)
    cap = start + attend.MAX_ROWS + 5
    k = torch.randn(KV, cap, D, generator=gen)  # [KV, cap, D]
    v = torch.randn(KV, cap, D, generator=gen)
    for n in (1, 2, 3, 9, 17, attend.MAX_ROWS):
        q = torch.randn(n, H, D, generator=gen) * 2  # [n, H, D]: larger scores, a peakier softmax
        out = torch.empty(n, H * D)
        attend.attend(q, k, v, out, start, D**-0.5)
        assert torch.allclose(out, reference(q, k, v, start, D**-0.5), rtol=1e-4, atol=2e-5), n


@needs_kernel
def test_strided_rows_as_the_forward_passes_them() -> None:
    """The forward hands q as a view of its rotated [n, H + KV, D] block and writes into a slice of a
    wider output: rows strided, heads and dims contiguous."""
    gen = torch.Generator().manual_seed(7)
    H, KV, D, n, start = 9, 3, 64, 5, 200
    qk = torch.randn(n, H + KV, D, generator=gen)  # [n, H+KV, D]
    k = torch.randn(KV, start + n, D, generator=gen)
    v = torch.randn(KV, start + n, D, generator=gen)
    wide = torch.full((n + 2, H * D), float("nan"))
    attend.attend(qk[:, :H], k, v, wide[1 : n + 1], start, 0.125)
    assert torch.allclose(wide[1 : n + 1], reference(qk[:, :H].contiguous(), k, v, start, 0.125), rtol=1e-4, atol=2e-5)
    assert wide[0].isnan().all() and wide[n + 1].isnan().all()  # nothing written outside the slice


@needs_kernel
def test_the_same_inputs_give_the_same_bits() -> None:
    """Deterministic: the work is split between threads by the context's length alone and merged in
    a fixed order, so a plain step and a verification block of the same shape compute alike."""
    gen = torch.Generator().manual_seed(9)
    k = torch.randn(3, 4100, 64, generator=gen)
    v = torch.randn(3, 4100, 64, generator=gen)
    q = torch.randn(9, 9, 64, generator=gen)
    outs = []
    for _ in range(5):
        out = torch.empty(9, 9 * 64)
        attend.attend(q, k, v, out, 4000, 0.125)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_kernel
def test_bad_arguments_are_refused_not_read_out_of_bounds() -> None:
    k = torch.randn(3, 40, 64)
    v = torch.randn(3, 40, 64)
    out = torch.empty(2, 9 * 64)
    with pytest.raises(ValueError, match="start \\+ n <= cap"):  # past the cache's end
        attend.attend(torch.randn(2, 9, 64), k, v, out, 39, 0.125)
    with pytest.raises(ValueError, match="multiple of 16"):
        attend.attend(torch.randn(2, 9, 60), torch.randn(3, 40, 60), torch.randn(3, 40, 60), torch.empty(2, 540), 0, 0.1)
    with pytest.raises(ValueError, match="float32"):
        attend.attend(torch.randn(2, 9, 64, dtype=torch.float64), k, v, out, 0, 0.125)
    with pytest.raises(ValueError, match="contiguous"):  # a transposed cache: its pointer is not [KV, cap, D]
        attend.attend(torch.randn(2, 9, 64), k.transpose(1, 2).contiguous().transpose(1, 2), v, out, 0, 0.125)
    long = attend.MAX_ROWS + 1
    with pytest.raises(ValueError, match="n <="):  # a tree's masks are 32 bits
        attend.attend(torch.randn(long, 9, 64), torch.randn(3, 80, 64), torch.randn(3, 80, 64),
                      torch.empty(long, 576), 0, 0.125, tree=(ctypes.c_uint32 * long)(*[1] * long))
    assert attend.serves(long, 64, torch.float32, torch.device("cpu"))  # a prompt piece: ours too
    assert not attend.serves(1, 64, torch.bfloat16, torch.device("cpu"))


def test_without_the_kernel_the_forward_keeps_torchs(tmp_path) -> None:
    """In a fresh process with no usable compiler and an empty cache (or switched off): no crash, the
    kernel serves nothing, and a forward still runs through torch's attention."""
    code = (
        "import torch\n"
        "from tandem.engine.native import attend\n"
        "assert attend.library() is None\n"
        "assert not attend.serves(1, 64, torch.float32, torch.device('cpu'))\n"
        "print('torch serves')\n"
    )
    for env in ({"CC": str(tmp_path / "no-such-compiler")}, {"TANDEM_ATTENTION": "torch"}):
        env = {**env, "TANDEM_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        assert "torch serves" in res.stdout


@needs_kernel
@pytest.mark.parametrize("H, KV, D", [(9, 3, 64), (4, 2, 16), (8, 2, 128), (6, 1, 48)])
def test_a_rows_result_does_not_depend_on_its_block(H, KV, D) -> None:
    """Bit for bit: a query row in a block of n rows gives what the same row gives alone, one
    position at a time (a plain step), at any thread count, so a verification block computes a
    token's attention exactly as plain decoding does. The head sizes cover each way the value pass
    is compiled (6-row register blocks at 64, 3-row at 128, through memory at 16 and 48)."""
    gen = torch.Generator().manual_seed(D)
    for start in (0, 5, 250, 255, 256, 1000, 3000):
        n = 17
        k = torch.randn(KV, start + n, D, generator=gen)  # [KV, cap, D]
        v = torch.randn(KV, start + n, D, generator=gen)
        q = torch.randn(n, H, D, generator=gen)  # [n, H, D]
        block = torch.empty(n, H * D)
        attend.attend(q, k, v, block, start, D**-0.5)
        threads = torch.get_num_threads()
        try:
            for t in range(n):
                torch.set_num_threads(1 + t % 2)
                alone = torch.empty(1, H * D)
                attend.attend(q[t : t + 1], k, v, alone, start + t, D**-0.5)
                assert torch.equal(alone[0], block[t]), (start, t)
        finally:
            torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("H, KV, D", [(9, 3, 64), (8, 2, 128), (6, 1, 48)])
def test_a_prompt_gives_the_same_bits_in_any_pieces(H, KV, D) -> None:
    """Prefill: a prompt attended whole (blocks longer than 32 rows are split inside the kernel),
    in uneven pieces, or one position at a time gives each position the same bits; and it matches
    the reference. Chunked prefill under load, prefix sharing and a failover recompute positions in
    other pieces than an idle run, so this is what makes their tokens the same."""
    gen = torch.Generator().manual_seed(D + 5)
    L = 700
    k = torch.randn(KV, L, D, generator=gen)
    v = torch.randn(KV, L, D, generator=gen)
    q = torch.randn(L, H, D, generator=gen) * 2
    whole = torch.empty(L, H * D)
    attend.attend(q, k, v, whole, 0, D**-0.5)
    assert torch.allclose(whole, reference(q, k, v, 0, D**-0.5), rtol=1e-4, atol=2e-5)
    pieces = torch.empty(L, H * D)
    at = 0
    for n in (1, 40, 7, 256, 33, 100, 263):
        attend.attend(q[at : at + n], k, v, pieces[at : at + n], at, D**-0.5)
        at += n
    assert at == L and torch.equal(pieces, whole)
    for t in (0, 31, 32, 255, 256, 699):
        alone = torch.empty(1, H * D)
        attend.attend(q[t : t + 1], k, v, alone, t, D**-0.5)
        assert torch.equal(alone[0], whole[t]), t
    many = torch.empty(L, H * D)  # the same pieces as blocks of one call
    attend.attend_many([(q[a:e], k, v, many[a:e], a, None) for a, e in ((0, 300), (300, 333), (333, 700))], D**-0.5)
    assert torch.equal(many, whole)


@needs_kernel
def test_avx2_and_native_builds_give_the_same_bits() -> None:
    """The kernel built for AVX2 (`-march=haswell`: an AMD Zen 2/3 or older Intel host) gives the bits
    of this host's build (AVX-512 where it has it), so a session failed over between two kinds of
    host resumes on the same numbers. Where this host has no AVX-512 both builds are AVX2 and the
    test checks only that the two compile to the same arithmetic."""
    avx2 = avx2_build(attend, "CPU attention kernel")
    native = attend.library()
    gen = torch.Generator().manual_seed(3)
    for H, KV, D, start, n, half in ((9, 3, 64, 0, 120, False), (9, 3, 64, 1500, 9, True), (8, 2, 128, 300, 1, False),
                                     (6, 1, 48, 77, 40, True)):
        cap = start + n
        dt = torch.float16 if half else torch.float32
        k = torch.randn(KV, cap, D, generator=gen).to(dt)
        v = torch.randn(KV, cap, D, generator=gen).to(dt)
        q = torch.randn(n, H, D, generator=gen) * 3
        outs = []
        for lib in (native, avx2):
            out = torch.empty(n, H * D)
            rc = lib.tandem_attend(q.data_ptr(), H * D, k.data_ptr(), v.data_ptr(), out.data_ptr(), H * D, H, KV, n, D,
                                   start, cap, D**-0.5, torch.get_num_threads(), None, int(half), None, None, 0, 0)
            assert rc == 0
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), (H, KV, D, start, n, half)


def _tree_mask(parents: list[int], start: int) -> torch.Tensor:  # [n, start + n] bool
    n = len(parents)
    mask = torch.zeros(n, start + n, dtype=torch.bool)
    mask[:, :start] = True
    for r, par in enumerate(parents):
        mask[r, start + r] = True
        if par >= 0:
            mask[r, start:] |= mask[par, start:]
    return mask


@needs_kernel
@pytest.mark.parametrize("start", [0, 7, 250, 1000])
def test_tree_blocks_see_their_ancestors_only(start) -> None:
    """A token-tree block: each row attends to the cache and to itself and its ancestors in the
    block, against the reference with the same mask; a chain given as a tree is the causal call
    bit for bit."""
    gen = torch.Generator().manual_seed(start + 11)
    H, KV, D = 9, 3, 64
    for parents in ([-1, 0, 0, 1, 1, 2, 5, 5, 0], [-1, 0, 1, 2], [-1] + [0] * 20 + list(range(1, 11)),
                    [-1, 0]):
        n = len(parents)
        k = torch.randn(KV, start + n, D, generator=gen)
        v = torch.randn(KV, start + n, D, generator=gen)
        q = torch.randn(n, H, D, generator=gen) * 2
        out = torch.empty(n, H * D)
        attend.attend(q, k, v, out, start, D**-0.5, tree=attend.tree_bits(parents))
        want = reference(q, k, v, start, D**-0.5, _tree_mask(parents, start))
        assert torch.allclose(out, want, rtol=1e-4, atol=2e-5), parents
        if parents == list(range(-1, n - 1)):
            causal = torch.empty(n, H * D)
            attend.attend(q, k, v, causal, start, D**-0.5)
            assert torch.equal(out, causal)
    with pytest.raises(ValueError, match="earlier row"):
        attend.tree_bits([-1, 1])
    with pytest.raises(ValueError, match="rows' masks"):
        attend.attend(q, k, v, out, start, D**-0.5, tree=attend.tree_bits([-1]))


@needs_kernel
def test_many_blocks_in_one_call_give_each_block_its_bits_alone() -> None:
    """A batched step's sessions go through one call (`attend_many`, one parallel region for all
    blocks): each block's output equals the block attended alone bit for bit, whatever its
    neighbours: a one-token step, a chain, a token tree, contexts in one run or several, caches of
    different capacities, strided rows."""
    gen = torch.Generator().manual_seed(11)
    H, KV, D = 9, 3, 64
    shapes = [(1, 0, 40), (1, 300, 310), (9, 1000, 1020), (4, 255, 300), (17, 2049, 2100), (1, 4000, 4001)]
    trees = {3: attend.tree_bits([-1, 0, 0, 1])}
    blocks, alone = [], []
    for i, (n, start, cap) in enumerate(shapes):
        k = torch.randn(KV, cap, D, generator=gen)  # [KV, cap, D]
        v = torch.randn(KV, cap, D, generator=gen)
        qk = torch.randn(n, H + KV, D, generator=gen) * 2  # [n, H + KV, D]: q as the forward's strided view
        out = torch.full((n, H * D), float("nan"))
        blocks.append((qk[:, :H], k, v, out, start, trees.get(i)))
        ref = torch.empty(n, H * D)
        attend.attend(qk[:, :H], k, v, ref, start, 0.125, trees.get(i))
        alone.append(ref)
    attend.attend_many(blocks, 0.125)
    for (_, _, _, out, _, _), ref in zip(blocks, alone):
        assert torch.equal(out, ref)


@needs_kernel
def test_many_blocks_are_checked_like_one() -> None:
    """attend_many refuses what attend refuses, and blocks whose head layout differs from the first's."""
    gen = torch.Generator().manual_seed(12)
    k = torch.randn(3, 50, 64, generator=gen)
    good = (torch.randn(1, 9, 64, generator=gen), k, k.clone(), torch.empty(1, 9 * 64), 10, None)
    past_end = (torch.randn(2, 9, 64, generator=gen), k, k.clone(), torch.empty(2, 9 * 64), 49, None)
    with pytest.raises(ValueError, match="start \\+ n <= cap"):
        attend.attend_many([good, past_end], 0.125)
    other = torch.randn(1, 4, 64, generator=gen), torch.randn(4, 50, 64, generator=gen)
    with pytest.raises(ValueError, match="first's heads"):
        attend.attend_many([good, (other[0], other[1], other[1].clone(), torch.empty(1, 4 * 64), 10, None)], 0.125)


@needs_kernel
@pytest.mark.parametrize("H, KV, D", [(9, 3, 64), (8, 2, 128), (6, 1, 48)])
def test_a_float16_cache_gives_the_bits_of_its_float32_widening(H, KV, D) -> None:
    """A float16 cache (NativeLlama's kv_dtype) is read by widening each key and value exactly: the
    result equals the kernel's over `k.float()`, `v.float()` bit for bit (one row, a block, a tree,
    one call for many blocks), so the target with a float16 cache is one well-defined model, and
    close to torch's attention over the widened cache."""
    gen = torch.Generator().manual_seed(D)
    blocks16, blocks32 = [], []
    for i, (n, start) in enumerate([(1, 0), (1, 700), (9, 1000), (4, 2049), (attend.MAX_ROWS, 300)]):
        cap = start + n + 3
        k = (torch.randn(KV, cap, D, generator=gen) * 3).half()  # [KV, cap, D] float16
        v = torch.randn(KV, cap, D, generator=gen).half()
        q = torch.randn(n, H, D, generator=gen) * 2  # [n, H, D] float32
        tree = attend.tree_bits([-1, 0, 0, 1]) if n == 4 else None
        out16, out32 = torch.empty(n, H * D), torch.empty(n, H * D)
        attend.attend(q, k, v, out16, start, D**-0.5, tree)
        attend.attend(q, k.float(), v.float(), out32, start, D**-0.5, tree)
        assert torch.equal(out16, out32), (n, start)
        if tree is None:
            assert torch.allclose(out16, reference(q, k.float(), v.float(), start, D**-0.5), rtol=1e-4, atol=2e-5)
        blocks16.append((q, k, v, torch.empty(n, H * D), start, tree))
        blocks32.append((q, k.float(), v.float(), torch.empty(n, H * D), start, tree))
    attend.attend_many(blocks16, D**-0.5)
    attend.attend_many(blocks32, D**-0.5)
    for a, b in zip(blocks16, blocks32):
        assert torch.equal(a[3], b[3])
    with pytest.raises(ValueError, match="cache type"):  # one call reads one cache type
        attend.attend_many([blocks16[0], blocks32[1]], D**-0.5)
    with pytest.raises(ValueError, match="float16"):  # bfloat16 would be read as float16: refused
        attend.attend(blocks16[0][0], blocks16[0][1].bfloat16(), blocks16[0][2].bfloat16(), blocks16[0][3], 0, 0.1)


@needs_kernel
@pytest.mark.parametrize("half", [False, True])
def test_a_shared_prefix_gives_the_bits_of_one_cache(half) -> None:
    """Positions 0 .. plen-1 read from another cache (a tenant's tool list held once) and the rest
    from the block's own: every row, causal or tree, alone or beside other blocks, gets the bits
    it gets with the whole context in one cache. The prefix's cache may be longer than the prefix
    (its owner's cache, positions past plen are never read)."""
    gen = torch.Generator().manual_seed(7 + half)
    H, KV, D = 9, 3, 64
    dt = torch.float16 if half else torch.float32
    for plen, start, n in ((256, 256, 1), (256, 300, 9), (512, 700, 33), (1024, 1024, 40), (256, 1500, 1)):
        cap = start + n + 5
        k = torch.randn(KV, cap, D, generator=gen).to(dt)
        v = torch.randn(KV, cap, D, generator=gen).to(dt)
        q = torch.randn(n, H, D, generator=gen) * 2
        owner_k = torch.randn(KV, plen + 300, D, generator=gen).to(dt)  # another cache, longer than the prefix
        owner_v = torch.randn(KV, plen + 300, D, generator=gen).to(dt)
        owner_k[:, :plen], owner_v[:, :plen] = k[:, :plen], v[:, :plen]
        own_k, own_v = k[:, plen:].contiguous(), v[:, plen:].contiguous()  # position p at p - plen
        own_k[:, start + n - plen:] = float("nan")  # past the block: never read (a NaN would spread)
        whole, split = torch.empty(n, H * D), torch.empty(n, H * D)
        attend.attend(q, k, v, whole, start, D**-0.5)
        attend.attend(q, own_k, own_v, split, start, D**-0.5, prefix=(owner_k, owner_v, plen))
        assert torch.equal(split, whole), (plen, start, n)
        if n <= attend.MAX_ROWS:
            parents = [-1] + [r // 2 for r in range(n - 1)]
            bits = attend.tree_bits(parents)
            t_whole, t_split = torch.empty(n, H * D), torch.empty(n, H * D)
            attend.attend(q, k, v, t_whole, start, D**-0.5, tree=bits)
            attend.attend(q, own_k, own_v, t_split, start, D**-0.5, tree=bits, prefix=(owner_k, owner_v, plen))
            assert torch.equal(t_split, t_whole), (plen, start, n)
        # beside a block without a prefix, in one call
        other_q = torch.randn(3, H, D, generator=gen)
        other_alone, other_many, many = torch.empty(3, H * D), torch.empty(3, H * D), torch.empty(n, H * D)
        attend.attend(other_q, k, v, other_alone, 100, D**-0.5)
        attend.attend_many([(q, own_k, own_v, many, start, None, (owner_k, owner_v, plen)),
                            (other_q, k, v, other_many, 100, None)], D**-0.5)
        assert torch.equal(many, whole) and torch.equal(other_many, other_alone)


@needs_kernel
def test_a_shared_prefix_is_checked() -> None:
    """A prefix length off the kernel's runs, longer than its cache, or past the block's start is
    refused before the kernel reads anything."""
    k, v = torch.randn(3, 64, 64), torch.randn(3, 64, 64)
    pk, pv = torch.randn(3, 512, 64), torch.randn(3, 512, 64)
    out = torch.empty(1, 9 * 64)
    q = torch.randn(1, 9, 64)
    for plen, start in ((100, 300), (768, 800), (512, 300)):
        with pytest.raises(ValueError, match="multiple of 256"):
            attend.attend(q, k, v, out, start, 0.125, prefix=(pk, pv, plen))
    with pytest.raises(ValueError, match="start \\+ n <= cap"):  # the own part past its cache
        attend.attend(q, k, v, out, 256 + 64, 0.125, prefix=(pk, pv, 256))
