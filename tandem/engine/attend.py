"""Loads attend.c (the attention of a few query rows over a long KV cache), compiling it at first use.

Built like gemv.c (tandem.engine.gemv.build: the host's compiler, `-march=native`, cached per source,
flags and CPU). It needs AVX-512; on a CPU without it, without a compiler, or where the build fails,
`library()` is None and the native forward keeps torch's `scaled_dot_product_attention`.
`TANDEM_ATTENTION=torch` keeps torch's kernel everywhere (for comparison).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from tandem.engine import gemv

SOURCE = Path(__file__).with_name("attend.c")
MAX_ROWS = 32  # query rows per block it serves (decode and verification); a prefill goes to torch
MAX_HEAD_DIM = 256


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.tandem_attend
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
                   + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p])
    fn.restype = ctypes.c_int


_kernel = gemv.Kernel(SOURCE, "CPU attention kernel", _bind,
                      enabled=lambda: os.environ.get("TANDEM_ATTENTION", "auto") != "torch")


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built (or is switched off) here."""
    return _kernel.library()


def serves(n: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a block of `n` query rows of this head size goes through the kernel."""
    return (device.type == "cpu" and dtype == torch.float32 and 0 < n <= MAX_ROWS and head_dim % 16 == 0
            and head_dim <= MAX_HEAD_DIM and library() is not None)


def tree_bits(parents: list[int]) -> ctypes.Array:
    """The rows' visibility masks of a token-tree block for `attend(tree=...)`: bit i of row r set
    when block row i is r itself or one of its ancestors. parents[r] is the block row r follows
    (-1 for row 0, the pending token); at most MAX_ROWS rows."""
    if len(parents) > MAX_ROWS:
        raise ValueError(f"a tree block has at most {MAX_ROWS} rows, got {len(parents)}")
    bits: list[int] = []
    for r, par in enumerate(parents):
        if not -1 <= par < r:
            raise ValueError(f"row {r}'s parent {par} is not an earlier row")
        bits.append((1 << r) | (bits[par] if par >= 0 else 0))
    return (ctypes.c_uint32 * len(bits))(*bits)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, start: int, scale: float,
           tree: ctypes.Array | None = None) -> None:
    """Causal attention of a block's queries over one layer's cache, written into `out`; with
    `tree` (`tree_bits` of the block) each row sees the cache and its own ancestors in the block.

    q `# [n, H, D]` (rows may be strided; heads and dims contiguous): the queries at positions
    start .. start+n-1; k, v `# [KV, cap, D]` contiguous, positions 0 .. start+n-1 valid; out
    `# [n, H * D]` (rows may be strided). Query head h reads KV head h // (H // KV).
    Same result as `F.scaled_dot_product_attention(q.transpose(0, 1), k[:, :start+n], v[:, :start+n],
    causal mask offset by start, enable_gqa=True)`, within float32 rounding (tested).
    """
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available on this host")
    n, H, D = q.shape
    KV, cap = k.shape[0], k.shape[1]
    ok = (q.dtype == k.dtype == v.dtype == out.dtype == torch.float32 and q.stride()[1:] == (D, 1)
          and k.is_contiguous() and v.is_contiguous() and k.shape == v.shape and k.shape[2] == D
          and out.stride(1) == 1 and tuple(out.shape) == (n, H * D) and H % KV == 0 and 0 < n <= MAX_ROWS
          and D % 16 == 0 and D <= MAX_HEAD_DIM and 0 <= start and start + n <= cap
          and all(t.device.type == "cpu" for t in (q, k, v, out)))
    if tree is not None and len(tree) != n:
        raise ValueError(f"tree has {len(tree)} rows' masks for a block of {n} rows")
    if not ok:  # the kernel reads raw pointers: anything else would read the wrong memory
        raise ValueError(f"attend takes float32 CPU q [n <= {MAX_ROWS}, H, D (a multiple of 16)], k/v contiguous "
                         f"[KV, cap, D] with start + n <= cap, out [n, H*D]; got q {tuple(q.shape)} {q.stride()}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, out {tuple(out.shape)}, start {start}")
    rc = lib.tandem_attend(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), out.data_ptr(), out.stride(0),
                           H, KV, n, D, start, cap, scale, torch.get_num_threads(),
                           None if tree is None else ctypes.addressof(tree))
    if rc != 0:
        raise MemoryError(f"the CPU attention kernel failed ({rc})")
