"""Loads gemv.c (a few-row GEMM that streams each weight once), compiling it at first use.

The shared library is built with the host's C compiler for this CPU (`-march=native`) into the tandem
cache, keyed by the source, the flags and the CPU model, so a different machine builds its own. No
compiler, a failed build or a library that does not load simply means the path is not offered: the
GEMM tuner then chooses among the library paths (tandem.engine.model.gemm).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from tandem.engine.native.build import Kernel, key_of

log = logging.getLogger("tandem.engine.native.gemv")

SOURCE = Path(__file__).with_name("gemv.c")
MAX_ROWS = 32  # the kernel keeps the activation rows in cache; beyond this a library GEMM wins


def source_key() -> str:
    """What identifies a build of the kernel: its source and flags (the GEMM plan is keyed by it)."""
    return key_of(SOURCE)


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.tandem_gemv_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 4
    fn.restype = None


_kernel = Kernel(SOURCE, "streaming GEMV kernel", _bind)


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built here."""
    return _kernel.library()


def gemv_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x `# [n, in]` float32 times w `# [out, in]` float32 (contiguous, CPU) -> `# [n, out]`, n <= MAX_ROWS.

    Threads: torch's intra-op count, in torch's own OpenMP pool (the library binds to the
    libgomp.so.1 torch already loaded; a second pool would spin against torch's on a small host).
    """
    lib = library()
    if lib is None:
        raise RuntimeError("the streaming GEMV kernel is not available on this host")
    n, k = x.shape
    m = w.shape[0]
    if (n > MAX_ROWS or w.shape[1] != k or x.dtype != torch.float32 or w.dtype != torch.float32
            or not w.is_contiguous() or x.device.type != "cpu" or w.device.type != "cpu"):
        # the kernel reads raw pointers: anything else would read the wrong memory
        raise ValueError(f"gemv_rows takes float32 CPU [n <= {MAX_ROWS}, in] x contiguous [out, in], got "
                         f"{tuple(x.shape)} x {tuple(w.shape)}")
    x = x.contiguous()
    y = torch.empty(n, m, dtype=torch.float32)
    lib.tandem_gemv_rows(x.data_ptr(), w.data_ptr(), y.data_ptr(), n, m, k, torch.get_num_threads())
    return y
