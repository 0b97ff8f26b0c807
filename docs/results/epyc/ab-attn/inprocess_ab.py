import ctypes, time, statistics, torch
torch.set_num_threads(2)
from tandem.engine.native import attend
from tandem.engine.model import loading as models
from tandem.engine.model.llama import NativeLlama
new = attend.library(); old = ctypes.CDLL("/tmp/attn/old_attend.so"); attend._bind(old)
m = models.load_model(progress=False); nat = NativeLlama(m.model)
ids = torch.randint(0, nat.vocab, (8200,)).tolist()
for ctx in (300, 4000, 8000):
    cache = nat.new_cache(ctx + 20); nat.forward(ids[:ctx], cache, all_logits=False)
    for n in (1, 9):
        res = {"old": [], "new": []}
        for rep in range(16):
            for name, lib in (("old", old), ("new", new)) if rep % 2 else (("new", new), ("old", old)):
                attend._kernel._lib = lib
                t = time.perf_counter(); nat.forward(ids[ctx:ctx + n], cache); res[name].append(time.perf_counter() - t); cache.crop_to(ctx)
        o, nw = statistics.median(res["old"]) * 1e3, statistics.median(res["new"]) * 1e3
        print(f"ctx {ctx} n {n}: old {o:.1f} ms new {nw:.1f} ms ({nw / o:.2f}x)")
