"""Loads gemv.c (a few-row GEMM that streams each weight once), compiling it at first use.

The shared library is built with the host's C compiler for this CPU (`-march=native`) into the tandem
cache, keyed by the source, the flags and the CPU model, so a different machine builds its own. No
compiler, a failed build or a library that does not load simply means the path is not offered: the
GEMM tuner then chooses among the library paths (tandem.engine.gemm).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("tandem.engine.gemv")

SOURCE = Path(__file__).with_name("gemv.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
MAX_ROWS = 32  # the kernel keeps the activation rows in cache; beyond this a library GEMM wins

def _key(source: Path) -> str:
    return hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]


def source_key() -> str:
    """What identifies a build of the kernel: its source and flags (the GEMM plan is keyed by it)."""
    return _key(SOURCE)


def build(source: Path, label: str, march: str = "native") -> ctypes.CDLL | None:
    """Compile `source` with the host's compiler into the tandem cache (once per source, flags,
    compiler and CPU) and load it; None, with the reason logged, where that is impossible here.
    `march`: the instruction set to build for (tests build an older one's code path, e.g. "haswell"
    for AVX2 without AVX-512, to check it gives the same bits)."""
    from tandem.engine.gemm import cpu_model
    from tandem.engine.models import cache_dir

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: the %s is not offered", label)
        return None
    flags = [f if f != "-march=native" else f"-march={march}" for f in FLAGS]
    key = hashlib.sha256(" ".join([_key(source), cc, cpu_model(), *([march] if march != "native" else [])]).encode()).hexdigest()[:16]
    out = cache_dir() / "gemv" / f"{source.stem}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}.so")
        res = subprocess.run([cc, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            log.warning("building the %s failed, it is not offered: %s", label, res.stderr.strip()[:500])
            return None
        tmp.replace(out)
    try:
        return ctypes.CDLL(str(out))
    except OSError as exc:
        log.warning("cannot load %s, the %s is not offered: %s", out, label, exc)
        return None


class Kernel:
    """A C source of ours compiled at first use (`build`), its functions typed by `bind`: `library()`
    is the loaded library, or None where it cannot be built here or `enabled()` says no. Decided
    once per process; asked on every call of the path, so no lock once it is known."""

    def __init__(self, source: Path, label: str, bind: Callable[[ctypes.CDLL], None],
                 enabled: Callable[[], bool] = lambda: True):
        self.source, self.label, self.bind, self.enabled = source, label, bind, enabled
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable

    def library(self) -> ctypes.CDLL | None:
        if self._lib is not None:
            return self._lib or None
        with self._lock:
            if self._lib is None:
                try:
                    lib = build(self.source, self.label) if self.enabled() else None
                    if lib is not None:
                        self.bind(lib)
                    self._lib = lib or False
                except (OSError, subprocess.SubprocessError) as exc:
                    log.warning("the %s is not available: %s", self.label, exc)
                    self._lib = False
        return self._lib or None


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
