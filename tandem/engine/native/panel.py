"""Loads panel.c (a few-row GEMM over a panel-packed weight, AVX-512 or AVX2), compiling it at first use.

Built like gemv.c (tandem.engine.native.build: the host's compiler, `-march=native`, cached per source,
flags and CPU). Where the CPU has neither AVX-512 nor AVX2 with FMA, no compiler works or the build fails, `library()` is
None and the GEMM tuner does not offer the path (tandem.engine.model.gemm).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tandem.engine.native import build

SOURCE = Path(__file__).with_name("panel.c")
LANES = 16  # outputs per panel (panel.c)
MAX_ROWS = 32  # rows per call; a forced plan's prefill runs in pieces of this many


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.tandem_panel_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 4
    fn.restype = None
    q8 = lib.tandem_panel_rows_q8
    q8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    q8.restype = None
    lib.tandem_panel_available.restype = ctypes.c_int
    if not lib.tandem_panel_available():
        raise OSError("built without AVX-512 or AVX2")


_kernel = build.Kernel(SOURCE, "panel GEMM kernel", _bind)


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built or has neither AVX-512 nor AVX2 here."""
    return _kernel.library()


def source_key() -> str:
    """What identifies a build of the kernel (the GEMM plan is keyed by it)."""
    return build.key_of(SOURCE)


def pack(w: torch.Tensor) -> torch.Tensor:
    """The panel layout `# [ceil(out/16), in, 16]` of a weight `# [out, in]`: 16 outputs' weights
    at each input position side by side, zero rows padding the last panel."""
    out, k = w.shape
    panels = -(-out // LANES)
    padded = torch.zeros(panels * LANES, k, dtype=torch.float32)
    padded[:out] = w
    return padded.view(panels, LANES, k).transpose(1, 2).contiguous()


def panel_rows(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x `# [n, in]` float32 times the weight packed by `pack` `# [panels, in, 16]` -> `# [n, out]`,
    n <= MAX_ROWS. Threads: torch's intra-op count, in torch's own OpenMP pool."""
    lib = library()
    if lib is None:
        raise RuntimeError("the panel GEMM kernel is not available on this host (needs AVX-512 or AVX2 and a C compiler)")
    n, k = x.shape
    if (n > MAX_ROWS or packed.dim() != 3 or packed.shape[1] != k or packed.shape[2] != LANES
            or packed.shape[0] != -(-out_features // LANES) or x.dtype != torch.float32
            or packed.dtype != torch.float32 or not packed.is_contiguous()
            or x.device.type != "cpu" or packed.device.type != "cpu"):
        # the kernel reads raw pointers: anything else would read the wrong memory
        raise ValueError(f"panel_rows takes float32 CPU [n <= {MAX_ROWS}, in] x a contiguous packed "
                         f"[ceil(out/16), in, 16] weight, got {tuple(x.shape)} x {tuple(packed.shape)} "
                         f"for {out_features} outputs")
    x = x.contiguous()
    y = torch.empty(n, out_features, dtype=torch.float32)
    lib.tandem_panel_rows(x.data_ptr(), packed.data_ptr(), y.data_ptr(), n, out_features, k, torch.get_num_threads())
    return y


class PackedWeight:
    """A weight `# [out, in]` packed once (`pack`) and checked once; a call checks only the
    activations x `# [n, in]` -> `# [n, out]`, any n (a forced plan's prefill runs in pieces of
    MAX_ROWS, each row's result the same in any piece). Why not `panel_rows` each time: a decode
    step makes 126 GEMM calls, and its checks of the packed weight cost ~4 us a call."""

    def __init__(self, w: torch.Tensor):
        if library() is None:
            raise RuntimeError("the panel GEMM kernel is not available on this host (needs AVX-512 or AVX2 and a C compiler)")
        self.out_features, self.in_features = w.shape
        self.packed = pack(w.detach().float())  # [ceil(out/16), in, 16]
        self._fn = library().tandem_panel_rows
        self._ptr = self.packed.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = x.shape
        if n > MAX_ROWS:
            return torch.cat([self(part) for part in x.split(MAX_ROWS)])
        if k != self.in_features or x.dtype != torch.float32 or x.device.type != "cpu":
            return panel_rows(x, self.packed, self.out_features)  # raises, naming what is wrong
        x = x.contiguous()
        y = torch.empty(n, self.out_features, dtype=torch.float32)
        self._fn(x.data_ptr(), self._ptr, y.data_ptr(), n, self.out_features, k, torch.get_num_threads())
        return y


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight `# [out, in]` as int8 with one scale per output: (q `# [out, in]` int8, scale `# [out]`
    float32), q * scale[:, None] ~= w (symmetric, |q| <= 127, round to nearest)."""
    w = w.detach().float()
    scale = (w.abs().amax(1) / 127.0).clamp_min(1e-12)  # [out]
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


class PackedInt8Weight:
    """An int8 weight with one scale per output (`quantize_int8`), in the panel layout
    `# [ceil(out/16), in, 16]` int8; a call takes float32 activations x `# [n, in]` -> `# [n, out]`
    float32: y = scale * (x . q), each output one chain in k order as in the float32 panels (so
    row-invariant too). For a draft model: a draft step is bound by reading its weights, and int8
    reads a quarter of float32's bytes; unlike torch's int8 matmul the activations stay float32."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        if library() is None:
            raise RuntimeError("the panel GEMM kernel is not available on this host (needs AVX-512 or AVX2 and a C compiler)")
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"PackedInt8Weight takes int8 q [out, in] and scale [out], got {q.dtype} "
                             f"{tuple(q.shape)} and {tuple(scale.shape)}")
        self.out_features, self.in_features = q.shape
        panels = -(-self.out_features // LANES)
        padded = torch.zeros(panels * LANES, self.in_features, dtype=torch.int8)
        padded[: self.out_features] = q
        self.packed = padded.view(panels, LANES, self.in_features).transpose(1, 2).contiguous()  # [panels, in, 16]
        self.scale = torch.zeros(panels * LANES, dtype=torch.float32)  # [panels * 16], zero on padding
        self.scale[: self.out_features] = scale.float()
        self._fn = library().tandem_panel_rows_q8

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = x.shape
        if n > MAX_ROWS:
            return torch.cat([self(part) for part in x.split(MAX_ROWS)])
        if k != self.in_features or x.device.type != "cpu":
            raise ValueError(f"PackedInt8Weight takes CPU activations [n, {self.in_features}], got {tuple(x.shape)} on {x.device}")
        x = x.float().contiguous()
        y = torch.empty(n, self.out_features, dtype=torch.float32)
        self._fn(x.data_ptr(), self.packed.data_ptr(), self.scale.data_ptr(), y.data_ptr(), n, self.out_features, k,
                 torch.get_num_threads())
        return y
