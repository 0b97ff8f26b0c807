import ctypes, time, statistics, torch
torch.set_num_threads(2)
from tandem.engine.native import quant
from tandem.engine.model import loading as models
from tandem.engine.model.llama import NativeLlama
new = quant.library(); old = ctypes.CDLL("/tmp/q_old.so"); quant._bind(old)
m = models.load_model(progress=False); nat = NativeLlama(m.model, quantized=m.quantized)
lins = [l[k] for l in nat.layers for k in NativeLlama._LINEAR] + nat.head_chunks
ids = torch.randint(0, nat.vocab, (600,)).tolist()
cache = nat.new_cache(600); nat.forward(ids[:300], cache, all_logits=False)
for n in (1, 5, 9, 13, 17):
    res = {"old": [], "new": []}
    for rep in range(12):
        for name, lib in (("old", old), ("new", new)) if rep % 2 else (("new", new), ("old", old)):
            for w in lins:
                w._fn = lib.tandem_quant_rows_q4 if w.kind != "Q8_0" else lib.tandem_quant_rows_q8
            t = time.perf_counter(); nat.forward(ids[300:300 + n], cache); res[name].append(time.perf_counter() - t); cache.crop_to(300)
    o, nw = statistics.median(res["old"]) * 1e3, statistics.median(res["new"]) * 1e3
    print(f"ctx 300, {n} tokens: old {o:.1f} ms new {nw:.1f} ms ({nw / o:.2f}x)")
