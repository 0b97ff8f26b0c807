# one-row decode step and a 9-row verify block at long context, the whole forward (this build's attend.c)
import time, statistics, torch, sys
from tandem.engine.model.loading import load_model
from tandem.engine.model.llama import NativeLlama
torch.set_num_threads(2)
lm = load_model(progress=False)
nat = NativeLlama(lm.model, quantized=lm.quantized)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, nat.vocab, (4000,), generator=g).tolist()
out = {}
for ctx in (300, 1500, 3000):
    c = nat.new_cache(ctx + 64); nat.forward(ids[:ctx], c, all_logits=False)
    for n in (1, 9):
        def step():
            c.length = ctx
            nat.forward_batch([(ids[ctx:ctx + n], c)], [True])
        step(); ts = []
        for _ in range(25):
            t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
        out[(ctx, n)] = statistics.median(ts) * 1e3
print(sys.argv[1], " ".join(f"{k[0]}/{k[1]}:{v:.2f}" for k, v in out.items()), flush=True)
