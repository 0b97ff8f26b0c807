"""One quantized GEMM, int8 against float32 activations (precision gguf vs gguf-float), same process,
the model's shapes and kinds (Q4_1 layers, the Q8_0 head), medians of 50 calls."""
import torch

from tandem.engine.model import gemm
from tandem.engine.native.quant import QuantizedWeight, QuantRows

torch.manual_seed(0)
print("kind   out x in      rows   int8 ms  float ms  ratio")
for kind, out, k in (("Q4_1", 960, 576), ("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576)):
    rows = QuantRows.quantize(torch.randn(out, k) * 0.05, kind)
    a, f = QuantizedWeight(rows, "int8"), QuantizedWeight(rows, "float32")
    for n in (1, 2, 4, 9, 17):
        x = torch.randn(n, k)
        ta, tf = gemm.median_seconds(lambda: a(x), 50), gemm.median_seconds(lambda: f(x), 50)
        print(f"{kind}  {out:5d} x {k:4d}  {n:4d}  {ta * 1e3:8.3f}  {tf * 1e3:8.3f}  {ta / tf:5.2f}")
