"""In one process: the forward with the residual add and the next norm in one call and silu(gate) * up in
one call (rowops) against the previous ops (torch's add, then the norm; slices, silu and a product),
swapped per step, 100 steps each, medians; argv[1] the precision."""
import statistics, sys, time
import torch
import torch.nn.functional as F
torch.set_num_threads(2)
from tandem.engine.model import llama
from tandem.engine.model.loading import load_model
from tandem.engine.model.llama import NativeLlama
new_add, new_gated = NativeLlama._add_rms, NativeLlama._gated
def old_add(self, x, o, w):
    if o is None:
        return x, self._rms(x, w)
    x = x + o
    return x, self._rms(x, w)
def old_gated(self, gu):
    inter = gu.shape[-1] // 2
    return F.silu(gu[:, :inter]) * gu[:, inter:]
t = load_model("default", progress=False, precision=sys.argv[1])
nat = NativeLlama(t.model, quantized=t.quantized)
ids = torch.randint(0, 49152, (400,)).tolist()
cache = nat.new_cache(400); nat.forward(ids[:300], cache, all_logits=False)
for n in (1, 9):
    ts = {"old": [], "new": []}; outs = {}
    for rep in range(100):
        for side, (a_, g_) in (("old", (old_add, old_gated)), ("new", (new_add, new_gated))):
            NativeLlama._add_rms, NativeLlama._gated = a_, g_
            a = time.perf_counter(); outs[side] = nat.forward(ids[300:300 + n], cache); ts[side].append(time.perf_counter() - a); cache.crop_to(300)
    diff = (outs["old"] - outs["new"]).abs().max().item()
    same_argmax = bool((outs["old"].argmax(-1) == outs["new"].argmax(-1)).all())
    o, nw = (statistics.median(ts[k]) * 1e3 for k in ("old", "new"))
    print(f"{sys.argv[1]} {n} tok: torch ops {o:.2f} ms, fused {nw:.2f} ms ({nw / o:.2f}x); logits differ by <= {diff:.2e} (silu's exp), same argmax {same_argmax}")
