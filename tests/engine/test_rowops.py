"""Our row-wise CPU kernels (tandem/engine/native/rowops.c) against their reference, transformers' RMSNorm.

Built with the host's C compiler at first use; where that is impossible the forward keeps torch's
fused op (tested with the other kernels in tests/engine/test_gemv.py).
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine.native import rowops

needs_kernel = pytest.mark.skipif(rowops.library() is None, reason="no C compiler here: torch's ops serve")


def reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in float64: x [n, d], w [d] -> [n, d]."""
    xd = x.double()
    return (w.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps))).float()


@needs_kernel
@pytest.mark.parametrize("d", [576, 64, 17, 5, 4096])
def test_rms_norm_matches_the_reference(d) -> None:
    gen = torch.Generator().manual_seed(d)
    w = torch.randn(d, generator=gen)
    for n in (1, 2, 9, 17, 100, 300):  # 100 and 300: split between threads
        x = torch.randn(n, d, generator=gen) * 5
        assert torch.allclose(rowops.rms_norm(x, w, 1e-5), reference(x, w, 1e-5), rtol=1e-5, atol=1e-5), n
    tiny = torch.full((1, d), 1e-20)  # eps dominates: no division by zero
    assert torch.isfinite(rowops.rms_norm(tiny, w, 1e-5)).all()


@needs_kernel
def test_a_rows_norm_does_not_depend_on_the_other_rows() -> None:
    """Bit for bit, alone or among others, strided or not, single- or multi-threaded (a prefill)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(576, generator=gen)
    x = torch.randn(200, 576, generator=gen)
    alone = torch.cat([rowops.rms_norm(x[i : i + 1], w, 1e-5) for i in range(len(x))])
    for rows in (1, 2, 9, 63, 64, 200):
        assert torch.equal(rowops.rms_norm(x[:rows], w, 1e-5), alone[:rows]), rows
    wide = torch.randn(200, 1000, generator=gen)
    wide[:, 100:676] = x
    assert torch.equal(rowops.rms_norm(wide[:, 100:676], w, 1e-5), alone)


@needs_kernel
def test_bad_arguments_are_refused_not_read_out_of_bounds() -> None:
    w = torch.randn(16)
    with pytest.raises(ValueError, match="float32"):
        rowops.rms_norm(torch.randn(2, 16, dtype=torch.float64), w, 1e-5)
    with pytest.raises(ValueError, match="unit stride"):
        rowops.rms_norm(torch.randn(16, 2).t(), w, 1e-5)
    with pytest.raises(ValueError, match="w \\[d\\]"):
        rowops.rms_norm(torch.randn(2, 15), w, 1e-5)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16), (2, 1, 6)])
def test_rope_store_equals_the_torch_ops_bit_for_bit(heads, kv_heads, head_dim) -> None:
    """The fused rotary embedding and cache write computes what the forward's torch ops computed
    (x * cos + roll(x, D/2) * signed_sin, then strided copies into the cache), to the last bit: a
    block on the fused path and one beside a prefill (torch's ops) get the same numbers."""
    from tandem.engine.model.llama import NativeLlama

    gen = torch.Generator().manual_seed(heads)
    H, KV, D, n, start, cap = heads, kv_heads, head_dim, 7, 40, 64
    qkv = torch.randn(n, (H + 2 * KV) * D + 5, generator=gen)[:, 5:]  # strided rows, as a slice of a batch
    positions = torch.tensor([40, 41, 42, 42, 43, 44, 47])  # a tree's repeated depths too
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()
    sin[:, : D // 2].neg_()
    k, v = torch.zeros(KV, cap, D), torch.zeros(KV, cap, D)
    q = torch.empty(n, H, D)
    rowops.rope_store(qkv, cos, sin, q, k, v, start)

    qk = NativeLlama._rotate(qkv[:, : (H + KV) * D].reshape(n, H + KV, D), cos[:, None], sin[:, None])
    k_ref, v_ref = torch.zeros(KV, cap, D), torch.zeros(KV, cap, D)
    k_ref[:, start : start + n] = qk[:, H:].transpose(0, 1)
    v_ref[:, start : start + n] = qkv[:, (H + KV) * D :].reshape(n, KV, D).transpose(0, 1)
    assert torch.equal(q, qk[:, :H])
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # and nothing outside the block's slots


@needs_kernel
def test_rope_store_refuses_what_would_write_out_of_bounds() -> None:
    qkv, cos, sin = torch.randn(3, 5 * 16), torch.randn(3, 16), torch.randn(3, 16)
    q, k, v = torch.empty(3, 3, 16), torch.zeros(1, 8, 16), torch.zeros(1, 8, 16)
    rowops.rope_store(qkv, cos, sin, q, k, v, 5)  # fits: positions 5..7
    with pytest.raises(ValueError, match="start"):
        rowops.rope_store(qkv, cos, sin, q, k, v, 6)  # position 8 is past the cache
    with pytest.raises(ValueError, match="qkv"):
        rowops.rope_store(torch.randn(3, 4 * 16), cos, sin, q, k, v, 0)  # too few heads for q_out
    with pytest.raises(ValueError, match="qkv"):
        rowops.rope_store(qkv, cos, sin, q, k.transpose(1, 2), v, 0)  # a view that is not [KV, cap, D]


@needs_kernel
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit() -> None:
    """The residual add and the next norm in one call: the same bits as torch's add and rms_norm."""
    gen = torch.Generator().manual_seed(4)
    for n, d in ((1, 576), (9, 576), (70, 64)):
        x, o, w = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen), torch.randn(d, generator=gen)
        expected_x = x + o
        expected_y = rowops.rms_norm(expected_x, w, 1e-5)
        y = rowops.add_rms_norm(x, o, w, 1e-5)  # x is updated in place
        assert torch.equal(x, expected_x) and torch.equal(y, expected_y)
    with pytest.raises(ValueError, match="contiguous"):
        rowops.add_rms_norm(torch.randn(4, 8).t(), torch.randn(8, 4), torch.randn(4), 1e-5)


@needs_kernel
def test_silu_mul_is_within_float_rounding_and_row_invariant() -> None:
    """silu(gate) * up with our exp: within a few float32 ulps of the float64 value (including
    large |gate|, where the exp is clamped and silu is 0 or the gate itself to float precision), and
    a row's bits do not depend on the rows beside it."""
    gen = torch.Generator().manual_seed(6)
    gu = torch.randn(33, 2 * 1536, generator=gen) * 4
    gu[0, :6] = torch.tensor([-100.0, -87.5, 0.0, 1e-30, 87.5, 100.0])
    out = rowops.silu_mul(gu)
    g, u = gu[:, :1536].double(), gu[:, 1536:].double()
    exact = g * torch.sigmoid(g) * u
    assert torch.allclose(out.double(), exact, rtol=4 * 2**-24, atol=1e-30)
    for r in (0, 5, 32):
        assert torch.equal(rowops.silu_mul(gu[r : r + 1].contiguous()), out[r : r + 1])
    with pytest.raises(ValueError, match="2 I"):
        rowops.silu_mul(torch.randn(2, 7))


@needs_kernel
def test_rope_store_into_a_float16_cache_rounds_as_torchs_cast() -> None:
    """Into a float16 cache each key and value is the float32 result rounded once, to nearest with
    ties to even, as torch's `.to(float16)` rounds: bit for bit, over values that round up, down, to
    even, into and out of subnormals, past the largest half (to infinity), and NaN / infinities."""
    H, KV, D, n, start, cap = 1, 1, 64, 40, 3, 48
    gen = torch.Generator().manual_seed(5)
    specials = torch.tensor([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, -65520.0, 1e6, float("inf"), float("-inf"),
                             float("nan"), 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14 - 2.0**-25,
                             1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2049.0, 2051.0, 6e-8, -6e-8, 1e-40, 3.0e-5])
    rand = torch.cat([torch.randn(n * D, generator=gen) * 10.0 ** torch.randint(-9, 6, (n * D,), generator=gen)])
    values = torch.cat([specials, rand])[: n * D]  # [n D]
    qkv = torch.zeros(n, (H + 2 * KV) * D)
    qkv[:, (H + KV) * D :] = values.view(n, D)  # the values go to the cache as they are: only the rounding acts
    qkv[:, H * D : (H + KV) * D] = torch.randn(n, D, generator=gen) * 100
    positions = torch.arange(start, start + n)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = torch.cat([positions.float()[:, None] * inv] * 2, -1)
    cos, sin = emb.cos(), emb.sin()
    sin[:, : D // 2].neg_()
    k32, v32 = torch.zeros(KV, cap, D), torch.zeros(KV, cap, D)
    k16, v16 = torch.zeros(KV, cap, D, dtype=torch.float16), torch.zeros(KV, cap, D, dtype=torch.float16)
    q32, q16 = torch.empty(n, H, D), torch.empty(n, H, D)
    rowops.rope_store(qkv, cos, sin, q32, k32, v32, start)
    rowops.rope_store(qkv, cos, sin, q16, k16, v16, start)
    assert torch.equal(q16, q32)  # the queries stay float32
    assert torch.equal(k16.view(torch.int16), k32.half().view(torch.int16))
    assert torch.equal(v16.view(torch.int16), v32.half().view(torch.int16))  # NaN's bits too
    assert v16[0, start, 5].isinf() and v16[0, start, 10].isnan() and v16[0, start, 4] == 65504  # row 0: specials
