"""The target's 121 GEMMs of a one-token step (the embedded Q4_1 file at precision gguf: 30 layers x 4 and the
head), called in sequence with one row each, median of 60 passes; and one call's fixed cost on a tiny weight."""
import statistics, time, torch, sys
torch.set_num_threads(2)
from tandem.engine.model.loading import load_model
from tandem.engine.model.llama import NativeLlama
t = load_model("default", progress=False, precision="gguf")
nat = NativeLlama(t.model, quantized=t.quantized)
weights = [l[k] for l in nat.layers for k in NativeLlama._LINEAR] + list(nat.head_chunks)
xs = [torch.randn(1, w.in_features) for w in weights]
nbytes = sum(w.q.numel() + (0 if w.dm is None else (w.dm.numel() * 4 if w.kind != "Q8_0" else w.dm.numel() * 2)) for w in weights)
def run():
    for w, x in zip(weights, xs): w(x)
ts = []
for _ in range(60):
    a = time.perf_counter(); run(); ts.append(time.perf_counter() - a)
m = statistics.median(ts)
print(f"{len(weights)} GEMMs, one row: {m*1e3:.2f} ms, {nbytes/1e6:.1f} MB read -> {nbytes/m/1e9:.1f} GB/s")
# empty-call overhead: a 16 x 32 weight
from tandem.engine.native.quant import QuantizedWeight, QuantRows
tiny = QuantizedWeight(QuantRows.quantize(torch.randn(16, 32), "Q4_1"), "int8")
x = torch.randn(1, 32)
ts = []
for _ in range(2000):
    a = time.perf_counter(); tiny(x); ts.append(time.perf_counter() - a)
print(f"one call on a 16 x 32 weight: {statistics.median(ts)*1e6:.1f} us")
