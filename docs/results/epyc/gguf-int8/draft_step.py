"""The distilled draft's one-token step (300-token context, median of 40) with its int8 weights on each
kernel that runs here, forced per weight through _Int8Weight.CHOSEN, in one process, three rounds."""
import statistics
import time

import torch

from tandem.engine.model import loading as models
from tandem.engine.model.llama import NativeLlama, _Int8Weight

torch.set_num_threads(2)
d = models.load_model("/root/.cache/tandem/drafts/SmolLM2-135M-Instruct-draft", progress=False)
ids = torch.randint(0, 49152, (400,)).tolist()


def step_ms(nat, reps=40):
    cache = nat.new_cache(400)
    nat.forward(ids[:300], cache, all_logits=False)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        nat.forward(ids[300:301], cache)
        ts.append(time.perf_counter() - t)
        cache.crop_to(300)
    return statistics.median(ts) * 1e3


measured = NativeLlama(d.model, int8=True)
print("kernels chosen by measurement:", dict(_Int8Weight.CHOSEN))
chosen = dict(_Int8Weight.CHOSEN)
forced = {}
for kernel in ("panel", "blocks", "torch"):
    _Int8Weight.CHOSEN.update({key: kernel for key in chosen})
    forced[kernel] = NativeLlama(d.model, int8=True)
_Int8Weight.CHOSEN.update(chosen)
f32 = NativeLlama(d.model)
for rep in range(3):
    print(f"float32 {step_ms(f32):.2f} ms | measured choice {step_ms(measured):.2f} ms | "
          + " | ".join(f"{k} {step_ms(m):.2f} ms" for k, m in forced.items()))
