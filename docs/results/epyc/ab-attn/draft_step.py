import time, torch, statistics
torch.set_num_threads(2)
from tandem.engine.model import loading as models
from tandem.engine.model.llama import NativeLlama, _Int8Weight
d = models.load_model("/root/.cache/tandem/drafts/SmolLM2-135M-Instruct-draft", progress=False)
ids = torch.randint(0, 49152, (400,)).tolist()
def step_ms(nat, reps=40):
    cache = nat.new_cache(400); nat.forward(ids[:300], cache, all_logits=False)
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); nat.forward(ids[300:301], cache); ts.append(time.perf_counter() - t); cache.crop_to(300)
    return statistics.median(ts) * 1e3
f32 = NativeLlama(d.model)
q = NativeLlama(d.model, int8=True)
print("kernels chosen:", _Int8Weight.CHOSEN)
# the same model forced onto torch's int8 kernel
qt = NativeLlama(d.model, int8=True)
for w in [l[k] for l in qt.layers for k in NativeLlama._LINEAR] + qt.head_chunks:
    if w.kernel == "panel":
        w.q = w._panel.packed.transpose(1, 2).reshape(-1, w._panel.in_features)[: w._panel.out_features].contiguous(); w.kernel = "torch"
for rep in range(3):
    print(f"float32 tuned {step_ms(f32):.2f} ms | int8 chosen {step_ms(q):.2f} ms | int8 torch {step_ms(qt):.2f} ms")
