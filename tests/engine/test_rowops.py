"""Our row-wise CPU kernels (tandem/engine/rowops.c) against their reference, transformers' RMSNorm.

Built with the host's C compiler at first use; where that is impossible the forward keeps torch's
fused op (tested with the other kernels in tests/engine/test_gemv.py).
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine import rowops

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
