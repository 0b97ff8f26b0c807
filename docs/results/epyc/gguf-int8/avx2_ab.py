"""The int8-activation GEMM built for AVX2 (-march=haswell, no AVX-512: what an AVX2-only host such as
a Zen 2/3 EPYC runs) against this host's AVX-512 VNNI build and the float-activation kernel, one
process, the model's shapes and kinds, medians of 50 calls. A stand-in for an AVX2 host: same
arithmetic and bits, this host's memory and clocks."""
import ctypes

import torch

from tandem.engine.model import gemm
from tandem.engine.native import gemv, quant
from tandem.engine.native.quant import QuantizedWeight, QuantRows

hsw = gemv.build(quant.SOURCE, "quantized GEMM kernel, AVX2 form", march="haswell")
quant._bind(hsw)
torch.manual_seed(0)
print(f"native int8 kernel: {quant.int8_isa()}; stand-in: {quant.int8_isa(hsw)}")
print("kind   out x in      rows   AVX2 ms  VNNI ms  float-act ms  AVX2/float")
for kind, out, k in (("Q4_1", 960, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)):
    rows = QuantRows.quantize(torch.randn(out, k) * 0.05, kind)
    a, f = QuantizedWeight(rows, "int8"), QuantizedWeight(rows, "float32")
    fn = hsw.tandem_quant_rows_q4a if rows.q4 else hsw.tandem_quant_rows_q8a
    for n in (1, 2, 4, 9, 17):
        x = torch.randn(n, k)
        y = torch.empty(n, out)

        def avx2():
            fn(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(a.q.data_ptr()), ctypes.c_void_p(a.dm.data_ptr()),
               ctypes.c_void_p(y.data_ptr()), n, out, k, torch.get_num_threads())

        th, ta, tf = (gemm.median_seconds(fn_, 50) for fn_ in (avx2, lambda: a(x), lambda: f(x)))
        assert torch.equal(y, a(x))
        print(f"{kind}  {out:5d} x {k:4d}  {n:4d}  {th * 1e3:8.3f}  {ta * 1e3:7.3f}  {tf * 1e3:12.3f}  {th / tf:10.2f}")
