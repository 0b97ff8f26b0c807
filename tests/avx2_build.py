"""Our C kernels built for an AVX2 host without AVX-512 (`-march=haswell`), to compare with this host's
build bit for bit: each kernel's AVX2 form promises the bits of its AVX-512 form (on an AVX-512 host
the comparison is between the two forms; elsewhere both builds are AVX2)."""

from __future__ import annotations

import ctypes

import pytest


def avx2_build(module, label: str) -> ctypes.CDLL:
    """`module`'s kernel (tandem.engine.native.attend, panel or quant: its SOURCE and _bind) built for
    haswell, bound; the test is skipped where the compiler cannot build for it."""
    from tandem.engine.native import build

    lib = build.build(module.SOURCE, f"{label}, AVX2 form", march="haswell")
    if lib is None:
        pytest.skip("the compiler cannot build for haswell here")
    module._bind(lib)
    return lib
