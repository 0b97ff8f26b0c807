"""Our streaming few-row GEMM (tandem/engine/native/gemv.c) against its reference, torch's F.linear.

It is built with the host's C compiler at first use; where that is impossible the path is simply
not offered, which is tested too (the tuner then picks among the library paths).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.model.gemm import GemmPath, GemmSettings, TunedLinear, candidates, forced_plan
from tandem.engine.native import gemv

needs_kernel = pytest.mark.skipif(gemv.library() is None, reason="no C compiler here: the path is not offered")


@needs_kernel
@pytest.mark.parametrize("out_features, in_features", [(40, 24), (96, 576), (33, 70), (7, 5)])
def test_the_kernel_matches_the_reference(out_features, in_features) -> None:
    """Odd sizes too: a width that is not a multiple of the 16 lanes, fewer outputs than threads."""
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen)  # [out, in]
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, gemv.MAX_ROWS):
        x = torch.randn(rows, in_features, generator=gen)  # [rows, in]
        y = gemv.gemv_rows(x, w)
        assert y.shape == (rows, out_features)
        assert torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-4), rows  # float32, sums of up to 576 terms


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    """Bit for bit: the same row alone, first, last, or among other rows gives the same output, so a
    plain step and a verification block compute a token's logits with identical arithmetic."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(300, 576, generator=gen)
    x = torch.randn(gemv.MAX_ROWS, 576, generator=gen)
    alone = torch.cat([gemv.gemv_rows(x[i : i + 1], w) for i in range(len(x))])
    for rows in range(1, gemv.MAX_ROWS + 1):
        assert torch.equal(gemv.gemv_rows(x[:rows], w), alone[:rows]), rows
    assert torch.equal(gemv.gemv_rows(x.flip(0), w), alone.flip(0))


@needs_kernel
def test_bad_arguments_are_refused_not_read_out_of_bounds() -> None:
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="float32"):
        gemv.gemv_rows(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="float32"):
        gemv.gemv_rows(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="float32"):
        gemv.gemv_rows(torch.randn(gemv.MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match="contiguous"):  # a transposed view: its pointer is not [out, in]
        gemv.gemv_rows(torch.randn(2, 8), torch.randn(8, 16).t())


@pytest.mark.parametrize("path", [p for p in (GemmPath.tandem_gemv, GemmPath.tandem_panel) if p in candidates()])
def test_a_forced_plan_runs_prefill_through_our_kernels_in_pieces(path) -> None:
    """gemv.c and panel.c take at most 32 rows a call; a forced plan's prefill goes in pieces."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(40, 24, generator=gen)
    lin = TunedLinear(w, forced_plan(path, [(40, 24)]))
    x = torch.randn(100, 24, generator=gen)  # more rows than one call takes
    y = lin(x)
    assert torch.allclose(y, F.linear(x, w), atol=1e-5)
    assert torch.equal(y[:5], lin(x[:5]))  # still row-invariant across the pieces


def test_without_a_compiler_the_path_is_not_offered(tmp_path) -> None:
    """In a fresh process with no usable compiler and an empty cache: no crash, no candidate, and
    forcing the path says why."""
    code = (
        "from tandem.engine.native import gemv, panel, quant, rowops\nfrom tandem.engine.model import gemm\n"
        "import torch\n"
        "from tandem.engine.model.llama import _Int8Weight\n"
        "assert gemv.library() is None\n"
        "assert quant.library() is None  # a GGUF target is then dequantized (tests/engine/test_quant.py)\n"
        "assert _Int8Weight(torch.randn(32, 64)).kernel == 'torch'  # a draft's int8 on torch's kernel\n"
        "assert rowops.library() is None  # the RMSNorm kernel too: the forward keeps torch's\n"
        "assert panel.library() is None  # and the panel kernel\n"
        "assert gemm.GemmPath.tandem_gemv not in gemm.candidates()\n"
        "assert gemm.GemmPath.tandem_panel not in gemm.candidates()\n"
        "for mode in ('tandem_gemv', 'tandem_panel'):\n"
        "    try:\n"
        "        gemm.GemmSettings.configure(mode)\n"
        "    except ValueError as exc:\n"
        "        print('refused:', exc)\n"
    )
    env = {"CC": str(tmp_path / "no-such-compiler"), "TANDEM_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "refused: GEMM mode 'tandem_gemv' needs its kernel built with a C compiler" in res.stdout
    assert "refused: GEMM mode 'tandem_panel' needs its kernel built with a C compiler" in res.stdout


def test_the_kernel_is_a_candidate_where_it_builds() -> None:
    assert (GemmPath.tandem_gemv in candidates()) == (gemv.library() is not None)
    GemmSettings.configure("invariant")
