"""Our C kernels, built for the CPU they run on: compiled with the host's C compiler at first use
(`-march=native`) into the tandem cache, keyed by the source, the flags, the compiler and the CPU
model, so a different machine builds its own. No compiler, a failed build or a library that does
not load means the kernel's path is not offered (logged), never a failure."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("tandem.engine.native.build")


FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def key_of(source: Path) -> str:
    """What identifies a build of `source`: its text and the flags."""
    return hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]


def build(source: Path, label: str, march: str = "native") -> ctypes.CDLL | None:
    """Compile `source` with the host's compiler into the tandem cache (once per source, flags,
    compiler and CPU) and load it; None, with the reason logged, where that is impossible here.
    `march`: the instruction set to build for (tests build an older one's code path, e.g. "haswell"
    for AVX2 without AVX-512, to check it gives the same bits)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: the %s is not offered", label)
        return None
    flags = [f if f != "-march=native" else f"-march={march}" for f in FLAGS]
    key = hashlib.sha256(" ".join([key_of(source), cc, cpu_model(), *([march] if march != "native" else [])]).encode()).hexdigest()[:16]
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



def cpu_model() -> str:
    """The CPU's model name as `lscpu` prints it (e.g. 'AMD EPYC', 'Intel(R) Xeon(R) ...')."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"



def cache_dir() -> Path:
    base = os.environ.get("TANDEM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tandem"
    )
    return Path(base)

