"""Our register-tiled GEMM on panel-packed weights (tandem/engine/native/panel.c) against its reference,
torch's F.linear, and the property the lossless rule leans on: a row's result does not depend on
the rows beside it, their number, or the thread count.

Built with the host's C compiler at first use and only for a CPU with AVX-512 or AVX2; elsewhere the path
is not offered (tested in tests/engine/test_gemv.py with the other kernels).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from avx2_build import avx2_build

from tandem.engine.model.gemm import GemmPath, candidates
from tandem.engine.native import panel

needs_kernel = pytest.mark.skipif(panel.library() is None, reason="no C compiler or neither AVX-512 nor AVX2 here: the path is not offered")


def test_the_packed_layout_puts_sixteen_outputs_side_by_side() -> None:
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)  # [out, in]
    packed = panel.pack(w)  # [2, 3, 16]
    assert packed.shape == (2, 3, 16)
    assert torch.equal(packed[0, 1], w[:16, 1])  # input position 1 of outputs 0..15
    assert torch.equal(packed[1, 2, :4], w[16:, 2])
    assert torch.equal(packed[1, :, 4:], torch.zeros(3, 12))  # the last panel's padding


@needs_kernel
@pytest.mark.parametrize("out_features, in_features", [(40, 24), (96, 576), (33, 70), (7, 5), (960, 1536)])
def test_the_kernel_matches_the_reference(out_features, in_features) -> None:
    """Odd sizes too: an output count that is not a multiple of 16 (a masked store), fewer panels
    than a tile group, fewer outputs than threads."""
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen)  # [out, in]
    packed = panel.pack(w)
    for rows in (*range(1, 18), 24, panel.MAX_ROWS):
        x = torch.randn(rows, in_features, generator=gen)  # [rows, in]
        y = panel.panel_rows(x, packed, out_features)
        assert y.shape == (rows, out_features)
        # A float32 sum of n products in any order is within n u sum|x_i w_i| of the exact sum (u =
        # 2^-24, the classic bound for recursive summation; ~1e-4 relative at 1,536 terms), so the
        # test holds on every CPU's summation order, while a wrong weight or input is off by O(1).
        # (A fixed 1e-4 tolerance failed on an Intel host: 3e-4 off near zero, MKL 3e-5.)
        exact = F.linear(x.double(), w.double())  # [rows, out]
        bound = in_features * 2.0**-24 * F.linear(x.double().abs(), w.double().abs())  # [rows, out]
        err = (y.double() - exact).abs()
        assert (err <= bound).all(), (rows, float((err - bound).max()))


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_threads() -> None:
    """Bit for bit: a row alone, first, last or among up to 31 others (every tile shape the kernel
    has), and at 1 or 2 threads, gives the same output: a plain step and a verification block
    compute a token's logits with identical arithmetic."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 576, generator=gen)  # 19 panels: groups of 4 and 2 and a last group of 3 or 1
    packed = panel.pack(w)
    x = torch.randn(panel.MAX_ROWS, 576, generator=gen)
    alone = torch.cat([panel.panel_rows(x[i : i + 1], packed, 300) for i in range(len(x))])
    for rows in range(1, panel.MAX_ROWS + 1):
        assert torch.equal(panel.panel_rows(x[:rows], packed, 300), alone[:rows]), rows
    assert torch.equal(panel.panel_rows(x.flip(0), packed, 300), alone.flip(0))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(panel.panel_rows(x[:9], packed, 300), alone[:9]), threads
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_bad_arguments_are_refused_not_read_out_of_bounds() -> None:
    packed = panel.pack(torch.randn(20, 16))  # [2, 16, 16]
    with pytest.raises(ValueError, match="float32"):
        panel.panel_rows(torch.randn(2, 15), packed, 20)  # wrong width
    with pytest.raises(ValueError, match="float32"):
        panel.panel_rows(torch.randn(2, 16), packed, 40)  # more outputs than the panels hold
    with pytest.raises(ValueError, match="float32"):
        panel.panel_rows(torch.randn(2, 16, dtype=torch.float64), packed, 20)
    with pytest.raises(ValueError, match="float32"):
        panel.panel_rows(torch.randn(panel.MAX_ROWS + 1, 16), packed, 20)
    with pytest.raises(ValueError, match="contiguous"):
        panel.panel_rows(torch.randn(2, 16), packed.transpose(0, 1), 20)
    with pytest.raises(ValueError, match="packed"):
        panel.panel_rows(torch.randn(2, 16), torch.randn(20, 16), 20)  # an unpacked weight


def test_the_kernel_is_a_candidate_where_it_builds() -> None:
    assert (GemmPath.tandem_panel in candidates()) == (panel.library() is not None)


@needs_kernel
@pytest.mark.parametrize("out_features, in_features", [(40, 24), (33, 70), (7, 5), (576, 1536)])
def test_int8_panels_match_dequantize_then_matmul(out_features, in_features) -> None:
    """The int8 kernel (a draft model's weights) against its reference: the int8 weights times their
    scales, then F.linear; one scale per output, odd sizes as above."""
    gen = torch.Generator().manual_seed(out_features + 1)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05  # [out, in]
    q, scale = panel.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-7  # rounding, no more
    weight = panel.PackedInt8Weight(q, scale)
    ref_w = q.float() * scale[:, None]  # [out, in]
    for rows in (1, 2, 5, 9, 13, 17, panel.MAX_ROWS, 40):
        x = torch.randn(rows, in_features, generator=gen)  # [rows, in]
        y = weight(x)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        torch.testing.assert_close(y, F.linear(x, ref_w), rtol=1e-4, atol=1e-4)
        alone = torch.cat([weight(x[r : r + 1]) for r in range(rows)])
        assert torch.equal(alone, y), rows  # row-invariant, like the float32 panels


@needs_kernel
def test_int8_panels_refuse_what_they_cannot_read() -> None:
    q, scale = panel.quantize_int8(torch.randn(20, 8))
    with pytest.raises(ValueError, match="int8 q"):
        panel.PackedInt8Weight(q.float(), scale)
    with pytest.raises(ValueError, match="int8 q"):
        panel.PackedInt8Weight(q, scale[:3])
    weight = panel.PackedInt8Weight(q, scale)
    with pytest.raises(ValueError, match=r"\[n, 8\]"):
        weight(torch.randn(2, 9))


@needs_kernel
def test_avx2_and_native_builds_give_the_same_bits() -> None:
    """The kernel built for AVX2 (`-march=haswell`) gives the bits of this host's build (AVX-512 where
    it has it): each output is one FMA chain in k order, whatever the vector width, so a float32
    target computes the same numbers on an AMD Zen 3 and an Intel AVX-512 host (a session failed
    over between them resumes on the same numbers). Float32 and int8 panels, rows 1 to 33."""
    avx2 = avx2_build(panel, "panel GEMM kernel")
    native = panel.library()
    gen = torch.Generator().manual_seed(9)
    for m, k in ((576, 576), (50, 96), (8192, 64)):
        w = torch.randn(m, k, generator=gen)
        packed = panel.pack(w)
        q, scale = panel.quantize_int8(w)
        q8 = panel.PackedInt8Weight(q, scale)
        for n in (1, 5, 9, 17, 32):
            x = torch.randn(n, k, generator=gen)
            outs, outs8 = [], []
            for lib in (native, avx2):
                y = torch.empty(n, m)
                lib.tandem_panel_rows(x.data_ptr(), packed.data_ptr(), y.data_ptr(), n, m, k, torch.get_num_threads())
                outs.append(y)
                y8 = torch.empty(n, m)
                lib.tandem_panel_rows_q8(x.data_ptr(), q8.packed.data_ptr(), q8.scale.data_ptr(), y8.data_ptr(), n, m, k,
                                         torch.get_num_threads())
                outs8.append(y8)
            assert torch.equal(outs[0], outs[1]), (m, k, n)
            assert torch.equal(outs8[0], outs8[1]), (m, k, n)
