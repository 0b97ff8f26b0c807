"""The machine's cost curve: what a target forward costs here, against what memory allows.

A speculative step pays off when a forward over k+1 tokens costs little more than over one, and a
one-token forward of a small model is bound by reading its weights. So we report, for the target as
the engine runs it (tuned GEMM paths, tandem.engine.model.gemm):
- the forward time at 1, 2, 3, 5, 9 and 17 new tokens on top of a 100 / 1,000 / 4,000-token cache;
- the memory bandwidth (a streaming read and a copy of a 256 MB buffer, with the process's threads);
- the bandwidth bound of a one-token step (the bytes of the weights a step reads / read bandwidth)
  and how far the measured step is above it, and the 9-token step relative to the 1-token step;
- since a step also reads the whole KV cache (46 KB a token for SmolLM2: 184 MB at 4,000 tokens, a
  third of the weights), the bound with the cache's bytes added, per context, and the ratio to it.
The benchmark report carries the same record, so every figure names its machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import torch

from tandem.engine.model.gemm import GemmPlan, median_seconds, shape_key
from tandem.engine.native.build import cpu_model

ROWS = (1, 2, 3, 5, 9, 17)
CONTEXTS = (100, 1000, 4000)
BANDWIDTH_BYTES = 256 << 20


@dataclass
class MachineCurve:
    cpu: str
    threads: int
    torch_version: str
    read_gbs: float  # streaming read of a 256 MB buffer (sum), GB/s: the best of before and after
    copy_gbs: float  # bytes copied per second (each byte read once and written once), GB/s
    weight_mb: float  # bytes of weights one step reads (embedding rows excluded: a step reads a few)
    bound_ms: float  # weight_mb / read bandwidth: the one-token step can be no faster
    read_gbs_range: tuple[float, float] = (0.0, 0.0)  # before and after the curve: shared hosts drift
    curve_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # context -> rows -> ms
    gemm: dict[str, list[str]] = field(default_factory=dict)  # shape -> chosen path per row slot
    kv_mb: dict[str, float] = field(default_factory=dict)  # context -> MB of KV cache a one-token step reads
    attention: str = ""  # which attention kernel served decode and verification blocks

    def ratios(self) -> dict[str, dict[str, float]]:
        """Per context: the 1-token step over the bound, and the 9-token step over the 1-token step."""
        out = {}
        for ctx, row in self.curve_ms.items():
            one = row.get("1")
            if one:
                out[ctx] = {"one_over_bound": round(one / self.bound_ms, 2),
                            "nine_over_one": round(row["9"] / one, 2) if "9" in row else None}
                if ctx in self.kv_mb:
                    out[ctx]["one_over_kv_bound"] = round(one / self.kv_bound_ms(ctx), 2)
        return out

    def kv_bound_ms(self, ctx: str) -> float:
        """The one-token bound at a context with the KV cache's bytes counted beside the weights'."""
        return (self.weight_mb + self.kv_mb[ctx]) / self.read_gbs

    def as_dict(self) -> dict:
        return {**asdict(self), "ratios": self.ratios()}


def bandwidth() -> tuple[float, float]:
    """(read GB/s, copy GB/s) over a buffer far larger than any cache."""
    src = torch.ones(BANDWIDTH_BYTES // 4)
    dst = torch.empty_like(src)
    read = median_seconds(src.sum, 7)
    copy = median_seconds(lambda: dst.copy_(src), 7)
    return BANDWIDTH_BYTES / read / 1e9, BANDWIDTH_BYTES / copy / 1e9


def weight_bytes(native) -> int:
    """Bytes of the weights a one-token step of a NativeLlama reads: every linear layer, the norms
    and the LM head (the input embedding contributes one row per token and is left out)."""
    def size(lin) -> int:  # a quantized weight (tandem.engine.native.quant) says its own size
        return lin.nbytes if hasattr(lin, "nbytes") else lin.w.numel() * lin.w.element_size()

    total = sum(size(c) for c in native.head_chunks)
    for layer in native.layers:
        for key in ("wqkv", "wo", "wgu", "wdown"):
            total += size(layer[key])
        total += 2 * layer["in_norm"].numel() * layer["in_norm"].element_size()
    return total


def kv_bytes(native, context: int) -> int:
    """Bytes of KV cache a one-token step reads at `context` tokens: every layer's keys and values."""
    return native.kv_bytes_per_slot * context


def measure(native, *, contexts=CONTEXTS, rows=ROWS, reps: int = 7, progress: bool = True) -> MachineCurve:
    """The cost curve of a NativeLlama on this machine (a few seconds per context)."""
    from tandem.engine.native.progress import progress_bar

    read, copy = bandwidth()
    wbytes = weight_bytes(native)
    curve = MachineCurve(cpu=cpu_model(), threads=torch.get_num_threads(), torch_version=torch.__version__,
                         read_gbs=0.0, copy_gbs=round(copy, 1), weight_mb=round(wbytes / 1e6, 3), bound_ms=0.0)
    from tandem.engine.native import attend

    kernel = attend.serves(1, native.head_dim, native.dtype, native.device)
    curve.attention = "tandem_attend (tandem/engine/native/attend.c)" if kernel else "torch scaled_dot_product_attention"
    curve.kv_mb = {str(ctx): round(kv_bytes(native, ctx) / 1e6, 3) for ctx in contexts}
    plan: GemmPlan | None = native.gemm_plan
    if plan is not None:
        curve.gemm = {k: v for k, v in plan.choice.items()}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, native.vocab, (max(contexts) + max(rows),), generator=gen).tolist()
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("measuring the cost curve", total=len(contexts) * len(rows))
        for ctx in contexts:
            cache = native.new_cache(ctx + max(rows))
            native.forward(ids[:ctx], cache, all_logits=False)
            # Steady state, as a decode loop runs: the first few one-token steps after a prefill
            # measured up to 1.4x slower than the rest on the Intel host (7 timed steps with one
            # untimed before them: median 6.0 ms against 4.2-4.4 later in the same process).
            for _ in range(reps):
                cache.length = ctx
                native.forward(ids[ctx : ctx + 1], cache)
            row_ms = {}
            for n in rows:
                def step(n=n):
                    cache.length = ctx  # every repetition verifies the same block on the same context
                    native.forward(ids[ctx : ctx + n], cache)
                row_ms[str(n)] = round(median_seconds(step, reps) * 1e3, 2)
                bar.advance(task)
            curve.curve_ms[str(ctx)] = row_ms
    # Measured again after: on a shared host the memory bandwidth drifts (2x within minutes was seen
    # here), and the bound must not flatter the curve, so it uses the better of the two.
    read_after, copy_after = bandwidth()
    best = max(read, read_after)
    curve.read_gbs, curve.read_gbs_range = round(best, 1), (round(read, 1), round(read_after, 1))
    curve.copy_gbs = round(max(copy, copy_after), 1)
    curve.bound_ms = round(wbytes / best / 1e6, 3)
    return curve


def format_curve(curve: MachineCurve):
    """A rich table of the curve, with the bound and the ratios."""
    from rich.table import Table

    rows = sorted({int(n) for r in curve.curve_ms.values() for n in r})
    table = Table(title=f"{curve.cpu}, {curve.threads} threads, torch {curve.torch_version}: forward ms by new tokens",
                  caption=(f"read {curve.read_gbs} GB/s (before/after: {curve.read_gbs_range[0]}/{curve.read_gbs_range[1]}), copy {curve.copy_gbs} GB/s; weights {curve.weight_mb:.1f} MB "
                           f"-> one-token bound {curve.bound_ms:.2f} ms; with the KV cache's bytes: the last column; "
                           f"attention: {curve.attention}"))
    table.add_column("context", justify="right")
    for n in rows:
        table.add_column(f"{n} tok", justify="right")
    table.add_column("1 tok / bound", justify="right")
    table.add_column("9 tok / 1 tok", justify="right")
    table.add_column("1 tok / bound + KV", justify="right")
    ratios = curve.ratios()
    for ctx, row in curve.curve_ms.items():
        r = ratios.get(ctx, {})
        table.add_row(ctx, *[f"{row[str(n)]:.1f}" if str(n) in row else "" for n in rows],
                      f"{r.get('one_over_bound', '')}x", f"{r.get('nine_over_one', '')}x",
                      f"{r['one_over_kv_bound']}x" if "one_over_kv_bound" in r else "")
    return table


def markdown_curve(curve: dict) -> list[str]:
    """The curve of a `MachineCurve.as_dict()` record as markdown lines (docs/benchmarks.md)."""
    rows = sorted({int(n) for r in curve["curve_ms"].values() for n in r})
    lines = [
        f"Cost curve ({curve['cpu']}, {curve['threads']} threads, torch {curve['torch_version']}): target forward "
        f"in ms by new tokens and tokens of context; read bandwidth {curve['read_gbs']} GB/s, weights "
        f"{curve['weight_mb']:.1f} MB, so a one-token step can be no faster than {curve['bound_ms']:.2f} ms"
        + (f"; with the KV cache it reads too, the bound of the last column; attention: {curve['attention']}."
           if curve.get("kv_mb") else "."),
        "",
    ]
    kv = bool(curve.get("kv_mb"))
    names = {f.name for f in fields(MachineCurve)}
    record = MachineCurve(**{k: v for k, v in curve.items() if k in names})  # a report may add keys
    head = "| context | " + " | ".join(f"{n} tok" for n in rows) + " | 1 tok / bound | 9 tok / 1 tok |"
    lines += [head + (" 1 tok / bound with KV |" if kv else ""), "|---:|" + "---:|" * (len(rows) + 2 + kv)]
    ratios = curve.get("ratios", {})
    for ctx, row in curve["curve_ms"].items():
        r = ratios.get(ctx, {})
        cells = [f"{row[str(n)]:.1f}" if str(n) in row else "" for n in rows]
        line = f"| {ctx} | " + " | ".join(cells) + f" | {r.get('one_over_bound', '')}x | {r.get('nine_over_one', '')}x |"
        if kv:
            line += (f" {r['one_over_kv_bound']}x ({record.kv_bound_ms(ctx):.1f} ms) |" if "one_over_kv_bound" in r
                     else " |")
        lines.append(line)
    return lines


def format_plan(plan: GemmPlan):
    """Which path serves each weight shape, by row count (runs of equal choices merged)."""
    from rich.table import Table

    from tandem.engine.model.gemm import SLOTS

    table = Table(title=f"GEMM paths ({plan.mode}" + (f", measured in {plan.tuned_s} s)" if plan.mode == "auto" else ")"))
    table.add_column("weight [out x in]")
    table.add_column("rows -> path")
    for key, paths in plan.choice.items():
        runs, start = [], 0
        for i in range(1, len(SLOTS) + 1):
            if i == len(SLOTS) or paths[i] != paths[start]:
                lo, hi = SLOTS[start], SLOTS[i - 1]
                if hi == SLOTS[-1]:  # the last slot serves every call above 17 rows
                    label = f"{lo}+" if lo != hi else f">{SLOTS[-2]}"
                else:
                    label = f"{lo}" if lo == hi else f"{lo}-{hi}"
                runs.append(f"{label}: {paths[start]}")
                start = i
        table.add_row(key, ", ".join(runs))
    return table


__all__ = ["MachineCurve", "measure", "bandwidth", "format_curve", "format_plan", "markdown_curve", "shape_key"]
