"""Loads rowops.c (row-wise operations of the native forward: RMSNorm, alone or after the residual
add; the gated MLP's silu(gate) * up; rotary embedding with the block's keys and values written into
the cache), compiling it at first use.

Built like gemv.c (tandem.engine.native.build: the host's compiler, cached per source, flags and CPU).
Without a compiler, or where the build fails, `library()` is None and the forward keeps torch's ops.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.engine.native import build

SOURCE = Path(__file__).with_name("rowops.c")


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.tandem_rms_norm
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 3 + [
        ctypes.c_float, ctypes.c_int]
    fn.restype = None
    fn = lib.tandem_add_rms_norm
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_float, ctypes.c_int]
    fn.restype = None
    fn = lib.tandem_silu_mul
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3
    fn.restype = None
    fn = lib.tandem_rope_store
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3
    fn.restype = None
    fn = lib.tandem_rope_store_many
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int]
    fn.restype = None


_kernel = build.Kernel(SOURCE, "row-wise CPU kernels", _bind)


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


def add_rms_norm(x: torch.Tensor, o: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x, o `# [n, d]` float32 CPU contiguous, w `# [d]`: x += o in place (torch's add, the same bits),
    then returns rms_norm(x, w, eps) `# [n, d]`, in one call."""
    lib = library()
    if lib is None:
        raise RuntimeError("the row-wise CPU kernels are not available on this host")
    n, d = x.shape
    ok = (x.dtype == o.dtype == w.dtype == torch.float32 and x.is_contiguous() and o.is_contiguous()
          and tuple(o.shape) == (n, d) and tuple(w.shape) == (d,) and w.is_contiguous()
          and x.device.type == o.device.type == w.device.type == "cpu")
    if not ok:  # the kernel reads and writes raw pointers: anything else would touch the wrong memory
        raise ValueError(f"add_rms_norm takes float32 CPU contiguous x, o [n, d] and w [d], got x {tuple(x.shape)}, "
                         f"o {tuple(o.shape)} {o.dtype}, w {tuple(w.shape)}")
    y = torch.empty(n, d, dtype=torch.float32)
    lib.tandem_add_rms_norm(x.data_ptr(), o.data_ptr(), w.data_ptr(), y.data_ptr(), n, d, eps, torch.get_num_threads())
    return y


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu `# [n, 2 I]` float32 CPU contiguous (gate, then up) -> silu(gate) * up `# [n, I]` (rowops.c:
    our exp, within ~2 float32 ulps of the exact value; row-invariant)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the row-wise CPU kernels are not available on this host")
    n, two = gu.shape
    if gu.dtype != torch.float32 or not gu.is_contiguous() or two % 2 or gu.device.type != "cpu":
        raise ValueError(f"silu_mul takes a float32 CPU contiguous [n, 2 I], got {gu.dtype} {tuple(gu.shape)}")
    out = torch.empty(n, two // 2, dtype=torch.float32)
    lib.tandem_silu_mul(gu.data_ptr(), out.data_ptr(), n, two // 2, torch.get_num_threads())
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, start: int) -> None:
    """One block's rotary embedding and cache write, in one call (see rowops.c):
    qkv `# [n, (H + 2 KV) D]` (rows may be strided), cos and signed sin `# [n, D]` (NativeLlama._rope),
    q_out `# [n, H, D]` contiguous <- rotated queries; k, v `# [KV, cap, D]` contiguous (one layer's
    cache, float32 or float16) <- rotated keys and the values at positions start .. start + n - 1 (in a
    float16 cache each rounded once from its float32 result, as torch's cast rounds)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the row-wise CPU kernels are not available on this host")
    n, H, D = q_out.shape
    KV, cap = k.shape[0], k.shape[1]
    ok = (qkv.dtype == cos.dtype == sin.dtype == q_out.dtype == torch.float32
          and k.dtype == v.dtype and k.dtype in (torch.float32, torch.float16)
          and qkv.dim() == 2 and qkv.shape == (n, (H + 2 * KV) * D) and qkv.stride(1) == 1
          and cos.shape == sin.shape == (n, D) and cos.is_contiguous() and sin.is_contiguous()
          and q_out.is_contiguous() and k.is_contiguous() and v.is_contiguous() and k.shape == v.shape
          and k.shape[2] == D and D % 2 == 0 and 0 <= start and start + n <= cap
          and all(t.device.type == "cpu" for t in (qkv, cos, sin, q_out, k, v)))
    if not ok:  # the kernel reads and writes raw pointers: anything else would touch the wrong memory
        raise ValueError(f"rope_store takes float32 CPU qkv [n, (H + 2 KV) D], cos/sin [n, D], q_out [n, H, D] and "
                         f"k/v [KV, cap, D] (float32 or float16) with start + n <= cap; got qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, "
                         f"q_out {tuple(q_out.shape)}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype}, start {start}")
    lib.tandem_rope_store(qkv.data_ptr(), qkv.stride(0), n, H, KV, D, cos.data_ptr(), sin.data_ptr(),
                          q_out.data_ptr(), k.data_ptr(), v.data_ptr(), cap, start, k.dtype == torch.float16)
