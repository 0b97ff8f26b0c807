"""In one process: a forward whose rotary/cache-write/attention calls go through the checked wrappers every
layer (slices, views and a buffer per layer, as before) against _FusedAttention (checked at layer 0, raw
calls after), swapped per step, 100 steps each, medians; argv[1] the precision."""
import statistics, time, sys, torch
torch.set_num_threads(2)
from tandem.engine.model import llama
from tandem.engine.native import rowops, attend
from tandem.engine.model.loading import load_model
from tandem.engine.model.llama import NativeLlama
fast = llama._FusedAttention.__call__
def checked(self, li, qkv):  # the previous code: checked wrappers, slices and views every layer
    att = torch.empty_like(self.att)  # it allocated per layer too
    for a, e, s, cache, tree in self.blocks:
        rowops.rope_store(qkv[a:e], self.cos2[a:e], self.sin2[a:e], self.q[a:e], cache.k[li], cache.v[li], s)
        attend.attend(self.q[a:e], cache.k[li], cache.v[li], self.att[a:e], s, self.scale, tree)
t = load_model("default", progress=False, precision=sys.argv[1])
nat = NativeLlama(t.model, quantized=t.quantized)
ids = torch.randint(0, 49152, (400,)).tolist()
cache = nat.new_cache(400); nat.forward(ids[:300], cache, all_logits=False)
for n in (1, 9):
    ts = {"checked": [], "raw": []}; outs = {}
    for rep in range(100):
        for side, fn in (("checked", checked), ("raw", fast)):
            llama._FusedAttention.__call__ = fn
            a = time.perf_counter(); outs[side] = nat.forward(ids[300:300 + n], cache); ts[side].append(time.perf_counter() - a); cache.crop_to(300)
    assert torch.equal(outs["checked"], outs["raw"])
    c, r = (statistics.median(ts[k]) * 1e3 for k in ("checked", "raw"))
    print(f"{sys.argv[1]} {n} tok: checked per layer {c:.2f} ms, raw after layer 0 {r:.2f} ms ({r / c:.2f}x), same bits")
