import time, statistics, torch, torch.nn.functional as F
from tandem.engine.native import attend
torch.set_num_threads(2)
H, KV, D = 9, 3, 64
for ctx in (500, 1500, 3000):
    k = torch.randn(KV, ctx + 64, D).half(); v = torch.randn(KV, ctx + 64, D).half()
    for n in (1, 4, 8, 16, 32):
        q = torch.randn(n, H, D); out = torch.empty(n, H * D)
        start = ctx
        def a(): attend.attend(q, k, v, out, start, 0.125)
        L = start + n
        mask = torch.ones(n, L, dtype=torch.bool).tril(diagonal=start)
        def s():
            kk, vv = k[:, :L].float(), v[:, :L].float()
            return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kk.unsqueeze(0), vv.unsqueeze(0), attn_mask=mask, scale=0.125, enable_gqa=True)
        res = {}
        for name, f in (("attend.c", a), ("sdpa", s)):
            f(); ts = []
            for _ in range(20):
                t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
            res[name] = statistics.median(ts) * 1e6
        print(f"ctx {ctx:5d} rows {n:3d}: attend.c {res['attend.c']:8.1f} us ({res['attend.c']/n:6.1f}/row)  sdpa {res['sdpa']:8.1f} us ({res['sdpa']/n:6.1f}/row)", flush=True)
