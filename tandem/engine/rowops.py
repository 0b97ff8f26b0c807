"""Loads rowops.c (row-wise operations of the native forward: RMSNorm), compiling it at first use.

Built like gemv.c (tandem.engine.gemv.build: the host's compiler, cached per source, flags and CPU).
Without a compiler, or where the build fails, `library()` is None and the forward keeps torch's ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.engine import gemv

SOURCE = Path(__file__).with_name("rowops.c")


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.tandem_rms_norm
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 3 + [
        ctypes.c_float, ctypes.c_int]
    fn.restype = None


_kernel = gemv.Kernel(SOURCE, "row-wise CPU kernels", _bind)


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built here."""
    return _kernel.library()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x `# [n, d]` float32 CPU (rows may be strided), w `# [d]` -> `# [n, d]`:
    w * (x * rsqrt(mean(x^2) + eps)) per row, each row on its own (row-invariant bit for bit)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the row-wise CPU kernels are not available on this host")
    n, d = x.shape
    ok = (x.dtype == w.dtype == torch.float32 and x.stride(1) == 1 and w.is_contiguous() and tuple(w.shape) == (d,)
          and x.device.type == "cpu" and w.device.type == "cpu")
    if not ok:  # the kernel reads raw pointers: anything else would read the wrong memory
        raise ValueError(f"rms_norm takes float32 CPU x [n, d] (unit stride along d) and w [d], got x "
                         f"{tuple(x.shape)} {x.stride()} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    y = torch.empty(n, d, dtype=torch.float32)
    lib.tandem_rms_norm(x.data_ptr(), x.stride(0), w.data_ptr(), y.data_ptr(), d, n, d, eps, torch.get_num_threads())
    return y
