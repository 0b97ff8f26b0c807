import time, statistics, torch, sys
from pathlib import Path
from tandem.engine.native import gemv, attend
torch.set_num_threads(2)
libs = {}
for name in sys.argv[1].split(","):
    lib = gemv.build(Path(f"/tmp/s17/ab/attend_{name}.c"), name); attend._bind(lib); libs[name] = lib
H, KV, D = 9, 3, 64
for ctx in (300, 1500, 3000):
    k = torch.randn(KV, ctx + 64, D).half(); v = torch.randn(KV, ctx + 64, D).half()
    for n in (1, 3, 5, 9, 16):
        q = torch.randn(n, H, D); out = torch.empty(n, H * D)
        ts = {nm: [] for nm in libs}
        for rep in range(15):
            for nm, lib in libs.items():
                t = time.perf_counter()
                for _ in range(10):
                    lib.tandem_attend(q.data_ptr(), H * D, k.data_ptr(), v.data_ptr(), out.data_ptr(), H * D, H, KV, n, D, ctx, k.shape[1], 0.125, 2, None, 1)
                ts[nm].append((time.perf_counter() - t) / 10)
        print(f"ctx {ctx:5d} rows {n:3d}: " + "  ".join(f"{nm} {statistics.median(v)*1e6:7.1f} us" for nm, v in ts.items()), flush=True)
