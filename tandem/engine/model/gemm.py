"""Which CPU GEMM path computes each linear layer of a float32 target.

By default (`GemmSettings.mode` "invariant") every call goes through one of our row-invariant
kernels (panel.c where it runs, else gemv.c; prefill in pieces of 32 rows), so a row's bits never
depend on the rows beside it or the piece its prompt arrived in: the same request gives the same
tokens idle and under load (docs/history.md, "One request, one answer"). "auto", described
below, trades that for speed: measured per machine, chosen per shape and rows.

Why: a step of a small model on a CPU is a few dozen GEMMs of 1-17 rows against weights read from
memory, and how close a GEMM gets to memory speed depends on the library path, the weight layout and
the CPU. Measured on two hosts of the same cloud type (docs/design.md, docs/benchmarks.md): on an Intel
Xeon MKL's `F.linear` is fine; on an AMD EPYC the same call reads the weight at ~11 GB/s for 1 row
and runs 2-3x slower again for 2-3 rows, while oneDNN with a pre-packed weight stays near ~25 GB/s
for 1-17 rows and our own streaming kernel (gemv.c) reads ~30 GB/s, the host's streaming rate, for
1-3 rows. No single path is best everywhere, so we measure.

The lossless rule (see docs/history.md, "GEMM paths"): **the path is a function of (weight
shape, row count) only**, fixed for the life of a model and shared by every forward of it: plain
decoding, verification blocks, prefill, batched sessions. So plain decoding and speculative decoding
compute a row count with the same arithmetic. Mixing paths by row count is allowed because no fast
library path here is row-count invariant anyway (measured: MKL NT, MKL NN and oneDNN each give
different bits for the same row at 1 vs 2+ rows; a per-row GEMV is invariant at 2-9x the cost;
our two kernels are invariant, each with its own bits, and where the panel kernel wins every decode
slot, as on the AMD EPYC host, the plan's decode path is invariant too), so the old fixed choice (NT up to 3 rows, NN above) already mixed paths by row count. What would break
the guarantee is a path that depends on anything else (timing, load, which session asked), and
that is what this module rules out: a plan is measured once, cached, and never changes under a
running model. Tests run greedy generations through every path the tuner can pick.

A plan is cached per machine under `<tandem cache>/gemm/`, keyed by CPU model, torch version,
thread count, the shapes, the candidates and our kernel's source; `tandem calibrate` prints it with the machine's cost curve.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.engine.native import gemv, panel
from tandem.engine.native.build import cpu_model

log = logging.getLogger("tandem.engine.model.gemm")

ROWS = tuple(range(1, 18))  # row counts of decode and verification steps (k <= 16 drafts + 1)
LARGE = 64  # a prefill-size call, measured once; any call above 17 rows uses its choice
SLOTS = (*ROWS, LARGE)
PLAN_VERSION = 6  # bump when candidates or the measurement change: old cached plans are ignored
MIN_COLD_BYTES = 96 << 20  # the least rotated through per measurement (above a common L3)
PAD_GAIN = 0.85  # pad a call to more rows only when that measured at least 15% faster: smaller
# gains did not survive the whole forward (3 rows padded to 6 measured 6% faster alone, ~10% slower
# in the model on the EPYC host), while 2 rows padded to 3-6 (17% alone) was faster there too
KEEP_WITHIN = 1.10  # a path already kept serves a row count when within 10% of that count's best
# (measurements on a shared host jitter by about that much; fewer layouts = less memory)


class GemmPath(str, Enum):
    mkl_nt = "mkl_nt"  # F.linear(x, W), W as stored [out, in]
    mkl_nn = "mkl_nn"  # x @ W_t with W_t = W.T made contiguous [in, out]
    onednn_b1 = "onednn_b1"  # oneDNN with a weight packed for 1-row calls
    onednn_b4 = "onednn_b4"  # ... packed for 4-row calls
    onednn_b16 = "onednn_b16"  # ... packed for 16-row calls
    gemv_rows = "gemv_rows"  # one GEMV per row (torch.mv): row-count invariant; for 1-2 rows only
    tandem_gemv = "tandem_gemv"  # our streaming few-row kernel (gemv.c, built at first use); up to 8 rows
    tandem_panel = "tandem_panel"  # our register-tiled kernel on a panel-packed weight (panel.c, AVX-512 or AVX2); up to 32 rows


GEMV_MAX_ROWS = 2  # gemv_rows re-reads the weight per row: never a candidate above this
STREAM_MAX_ROWS = 8  # tandem_gemv turns compute-bound beyond a few rows (measured: 1/3 of oneDNN at 9)
_PACK_HINT = {GemmPath.onednn_b1: 1, GemmPath.onednn_b4: 4, GemmPath.onednn_b16: 16}


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (private ops: checked, never assumed)."""
    try:
        w = torch.ones(8, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16), packed, None, "none", [], "")
        return bool(torch.allclose(out, torch.full((1, 8), 16.0)))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def candidates() -> list[GemmPath]:
    paths = [GemmPath.mkl_nt, GemmPath.mkl_nn, GemmPath.gemv_rows]
    if onednn_available():
        paths += [GemmPath.onednn_b1, GemmPath.onednn_b4, GemmPath.onednn_b16]
    if gemv.library() is not None:
        paths.append(GemmPath.tandem_gemv)
    if panel.library() is not None:
        paths.append(GemmPath.tandem_panel)
    return paths


def max_rows(path: GemmPath) -> int | None:
    """The most rows a path is measured (and used) for; None: any."""
    return {GemmPath.gemv_rows: GEMV_MAX_ROWS, GemmPath.tandem_gemv: STREAM_MAX_ROWS,
            GemmPath.tandem_panel: panel.MAX_ROWS}.get(path)


def prepare(w: torch.Tensor, path: GemmPath):
    """The layout `path` reads, made from a weight `# [out, in]`."""
    if path in (GemmPath.mkl_nt, GemmPath.gemv_rows, GemmPath.tandem_gemv):
        return w
    if path is GemmPath.mkl_nn:
        return w.t().contiguous()  # [in, out]
    if path is GemmPath.tandem_panel:
        return panel.PackedWeight(w)  # [ceil(out/16), in, 16] inside
    return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT[path])


def bind(path: GemmPath, prepared) -> Callable[[torch.Tensor], torch.Tensor]:
    """The call x `# [n, in]` -> `# [n, out]` of `path` on the weight held in `prepared` (see
    `prepare`). Chosen once per layer and row slot: a decode step makes 126 of these calls, and on
    a CPU host each microsecond of dispatch is ~0.5% of a one-token step."""
    if path is GemmPath.mkl_nt:
        return lambda x: F.linear(x, prepared)
    if path is GemmPath.mkl_nn:
        return lambda x: x @ prepared
    if path is GemmPath.gemv_rows:
        return lambda x: torch.stack([torch.mv(prepared, row) for row in x])
    if path is GemmPath.tandem_gemv:
        def stream(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] <= gemv.MAX_ROWS:
                return gemv.gemv_rows(x, prepared)
            # a forced plan's prefill: in pieces (each row's result is the same in any piece)
            return torch.cat([gemv.gemv_rows(part, prepared) for part in x.split(gemv.MAX_ROWS)])
        return stream
    if path is GemmPath.tandem_panel:
        return prepared  # a PackedWeight is its own call (forced prefills in pieces too)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, prepared, None, "none", [], "")


def slot_of(rows: int) -> int:
    """Index into `SLOTS` of the choice that serves a call of `rows` rows."""
    return rows - 1 if rows <= ROWS[-1] else len(ROWS)


def shape_key(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


@dataclass
class GemmPlan:
    """The chosen path per weight shape and row slot, with the measurements it was chosen from."""

    cpu: str
    torch_version: str
    threads: int
    mode: str  # "auto" (measured) or the one path forced for every call
    choice: dict[str, list[str]]  # shape key -> "path" or "path@m" (pad to m rows) per slot (SLOTS order)
    times_us: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)  # shape -> path -> per slot
    tuned_s: float = 0.0  # how long the measurement took

    def path(self, shape: tuple[int, int], rows: int) -> tuple[GemmPath, int]:
        """(path, rows to compute) for a call of `rows` rows: padded with zero rows where a
        slightly larger call is faster (oneDNN: 1-2 rows cost more than 3-5 on the EPYC host)."""
        return parse_choice(self.choice[shape_key(shape)][slot_of(rows)], rows)


def parse_choice(entry: str, rows: int) -> tuple[GemmPath, int]:
    path, _, pad = entry.partition("@")
    return GemmPath(path), max(rows, int(pad)) if pad else rows


def forced_plan(path: GemmPath, shapes: list[tuple[int, int]]) -> GemmPlan:
    """One path for every shape and row count (`TANDEM_GEMM=<path>`; tests of each path)."""
    return GemmPlan(cpu_model(), torch.__version__, torch.get_num_threads(), path.value,
                    {shape_key(s): [path.value] * len(SLOTS) for s in shapes})


def last_level_cache_bytes() -> int:
    """Size of this CPU's largest cache as the OS reports it (0 where unknown)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG" else int(text))
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return max(sizes, default=0)


def cold_bytes(model_bytes: int) -> int:
    """Bytes of weights to rotate through when timing a path, so that each call finds its weight
    where the model's forward would: a step reads every weight once, so a weight comes back after
    `model_bytes` of others. A model larger than the last-level cache reads from DRAM; rotating
    through twice that cache (at least MIN_COLD_BYTES) reproduces it. A smaller model (tests' tiny
    ones) stays in cache in the forward too, and is timed so.

    Why not a fixed 96 MB: an Intel Xeon host here reports a 504 MB L3, where 96 MB of weights stayed
    cached: MKL measured ~45 GB/s at 2-3 rows there, ~25 GB/s from DRAM, and the plan it chose (MKL
    padded to 3 rows) was ~1.5x slower in the model than what it measured."""
    return max(1, min(model_bytes, max(MIN_COLD_BYTES, 2 * last_level_cache_bytes())))


def _bytes_of(shapes: list[tuple[int, int]]) -> int:
    """float32 bytes of one weight of each shape: the least a model with these shapes reads a step."""
    return sum(4 * s[0] * s[1] for s in set(shapes))


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """The median wall time of `reps` calls of `fn`, after one untimed call (first touch of its
    memory, a kernel's first load)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_path(path: GemmPath, weights: list, rows: int, in_features: int, reps: int) -> float:
    """Median seconds of one call of `path` at `rows` rows, each call on the next of `weights`
    (prepared layouts), so every call reads its weight from memory as in a real forward."""
    x = torch.randn(rows, in_features)
    calls = [bind(path, w) for w in weights]  # bound once, as TunedLinear does
    for call in calls[:2]:  # warm-up: first-call allocations, thread pool start (not a whole pass:
        call(x)  # with a large rotation that would be the dearest part of tuning)
    passes = []
    for _ in range(reps):
        start = time.perf_counter()
        for call in calls:
            call(x)
        passes.append((time.perf_counter() - start) / len(calls))
    return statistics.median(passes)


def _with_padding(times: list[float | None]) -> tuple[list[float | None], list[int]]:
    """A path's time per slot when a call may be padded to more rows (up to 17), and the row count
    each slot then computes. Only decode slots pad; the prefill slot runs as it is."""
    eff, pad_to = list(times), list(SLOTS)
    for i in range(len(ROWS)):
        for j in range(i + 1, len(ROWS)):
            if times[j] is not None and (eff[i] is None or times[j] < eff[i]) and (
                    times[i] is None or times[j] <= PAD_GAIN * times[i]):
                eff[i], pad_to[i] = times[j], SLOTS[j]
    return eff, pad_to


def _prune(times: dict[GemmPath, list[float | None]]) -> list[str]:
    """Per slot, the path to use (with the rows to pad to, "path@m", where padding is faster): the
    fastest, except that a path already needed elsewhere serves a slot where it is within
    KEEP_WITHIN of the best (fewer layouts kept in memory)."""
    padded = {p: _with_padding(t) for p, t in times.items()}
    pads = {p: padded[p][1] for p in times}
    times = {p: padded[p][0] for p in times}
    best = [min(t[i] for t in times.values() if t[i] is not None) for i in range(len(SLOTS))]
    wins: dict[GemmPath, int] = {}
    for i in range(len(SLOTS)):
        winner = min((p for p in times if times[p][i] is not None), key=lambda p: times[p][i])
        wins[winner] = wins.get(winner, 0) + 1
    kept: list[GemmPath] = []
    out: list[str] = []
    for i in range(len(SLOTS)):
        ok = [p for p in sorted(wins, key=lambda p: -wins[p]) if times[p][i] is not None and times[p][i] <= best[i] * KEEP_WITHIN]
        pick = next((p for p in ok if p in kept), ok[0])
        if pick not in kept:
            kept.append(pick)
        pad = pads[pick][i]
        out.append(pick.value if pad == SLOTS[i] else f"{pick.value}@{pad}")
    return out


def tune(shapes: list[tuple[int, int]], *, reps: int = 3, progress: bool = False,
         rotate_bytes: int | None = None) -> GemmPlan:
    """Measure every candidate path for every shape at every row slot; choose per slot. Each
    measurement rotates through `rotate_bytes` of copies of the weight (default: one weight of
    each shape's worth, see `cold_bytes`)."""
    rotate = rotate_bytes or cold_bytes(_bytes_of(shapes))
    from tandem.engine.native.progress import progress_bar

    paths = candidates()
    start = time.perf_counter()
    plan = GemmPlan(cpu_model(), torch.__version__, torch.get_num_threads(), "auto", {})
    gen = torch.Generator().manual_seed(0)
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("measuring GEMM paths", total=len(shapes) * len(paths))
        for shape in shapes:
            copies = max(1, rotate // (shape[0] * shape[1] * 4))
            base = [torch.randn(shape, generator=gen) * 0.05 for _ in range(copies)]
            times: dict[GemmPath, list[float | None]] = {}
            for path in paths:
                weights = [prepare(w, path) for w in base]
                times[path] = [
                    None if max_rows(path) is not None and rows > max_rows(path)
                    else _time_path(path, weights, rows, shape[1], reps)
                    for rows in SLOTS
                ]
                del weights
                bar.advance(task)
            key = shape_key(shape)
            plan.choice[key] = _prune(times)
            plan.times_us[key] = {p.value: [None if t is None else round(t * 1e6, 1) for t in ts] for p, ts in times.items()}
    plan.tuned_s = round(time.perf_counter() - start, 2)
    return plan


# our kernels, built at first use: what forcing one needs where it is not offered
_OUR_KERNELS = {
    GemmPath.tandem_gemv.value: ", which failed or is missing here",
    GemmPath.tandem_panel.value: " for a CPU with AVX-512 or AVX2; the build failed, the compiler is missing or the CPU lacks both",
}


INVARIANT = "invariant"  # the default mode: every float32 GEMM on one of our row-invariant kernels


def invariant_path() -> GemmPath | None:
    """The kernel of the "invariant" mode here: the panel kernel where it runs (AVX-512 or AVX2, the
    same bits on both; fast at every row count), else the streaming kernel (any host with a C
    compiler; compute-bound beyond a few rows); None where neither loads."""
    paths = candidates()
    for path in (GemmPath.tandem_panel, GemmPath.tandem_gemv):
        if path in paths:
            return path
    return None


class GemmSettings:
    """Process-wide GEMM mode: "invariant" (the default: one row-invariant kernel of ours for every
    call, so a row's bits never depend on the rows beside it), "auto" (the fastest path per shape
    and row count, measured once per machine and cached; lossless by the shared-path rule, but a
    prompt prefilled in other pieces or a row batched with others can get other bits) or one
    forced path.

    Set once at the edge (`tandem --gemm` / TANDEM_GEMM, see tandem.tools.cli); models built later
    read it. Where neither of our kernels builds (no C compiler), "invariant" falls back to "auto"
    and says so in the log.
    """

    mode: str = INVARIANT
    cache: Path | None = None  # default: <tandem cache>/gemm
    progress: bool = True

    @classmethod
    def configure(cls, mode: str = INVARIANT, *, cache: Path | None = None, progress: bool | None = None) -> None:
        if mode not in ("auto", INVARIANT) and mode not in GemmPath.__members__:
            raise ValueError(f"unknown GEMM mode {mode!r}: {INVARIANT}, auto or one of {', '.join(GemmPath.__members__)}")
        if mode.startswith("onednn") and not onednn_available():
            raise ValueError(f"GEMM mode {mode!r} needs oneDNN, which this torch build lacks")
        if mode in _OUR_KERNELS and GemmPath(mode) not in candidates():
            raise ValueError(f"GEMM mode {mode!r} needs its kernel built with a C compiler (cc){_OUR_KERNELS[mode]} "
                             "(see the log)")
        cls.mode = mode
        cls.cache = cache
        if progress is not None:
            cls.progress = progress


_memo: dict[str, GemmPlan] = {}
_memo_lock = threading.Lock()  # models built in two threads at once measure once, not twice


def plan_key(shapes: list[tuple[int, int]], rotate_bytes: int | None = None) -> str:
    raw = json.dumps([PLAN_VERSION, cpu_model(), torch.__version__, torch.get_num_threads(),
                      sorted(shape_key(s) for s in shapes), [p.value for p in candidates()],
                      gemv.source_key(), panel.source_key(),  # a changed kernel is measured again
                      (rotate_bytes or cold_bytes(_bytes_of(shapes))) >> 20])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def plan_for(shapes: list[tuple[int, int]], model_bytes: int | None = None) -> GemmPlan:
    """The plan for a model with these weight shapes under the configured mode: forced, or the
    cached measurement for this machine, or a fresh measurement (a few seconds, saved).
    `model_bytes`: the bytes of all the model's weights that go through the plan (see `cold_bytes`;
    default: one weight of each shape)."""
    shapes = sorted(set(shapes))
    if GemmSettings.mode == INVARIANT:
        path = invariant_path()
        if path is not None:
            return forced_plan(path, shapes)
        _warn_not_invariant()
    elif GemmSettings.mode != "auto":
        return forced_plan(GemmPath(GemmSettings.mode), shapes)
    with _memo_lock:
        return _plan_for(shapes, cold_bytes(model_bytes or _bytes_of(shapes)))


@functools.cache
def _warn_not_invariant() -> None:
    log.warning("neither of our row-invariant GEMM kernels builds here (no C compiler?): float32 forwards use "
                "the measured library paths, so a row's bits can depend on the rows beside it")


def _plan_for(shapes: list[tuple[int, int]], rotate_bytes: int) -> GemmPlan:
    key = plan_key(shapes, rotate_bytes)
    if key in _memo:
        return _memo[key]
    from tandem.engine.native.build import cache_dir

    path = (GemmSettings.cache or cache_dir() / "gemm") / f"{key}.json"
    plan = None
    if path.exists():
        try:
            plan = GemmPlan(**json.loads(path.read_text()))
            plan.path(shapes[0], 1)  # validates the entries
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            log.warning("ignoring an unreadable GEMM plan %s (%s): measuring again", path, exc)
            plan = None
    if plan is None:
        log.info("measuring GEMM paths for %d weight shapes on %s (%d threads); cached in %s",
                 len(shapes), cpu_model(), torch.get_num_threads(), path.parent)
        plan = tune(shapes, progress=GemmSettings.progress, rotate_bytes=rotate_bytes)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
            tmp.write_text(json.dumps(asdict(plan), indent=1))
            tmp.replace(path)  # atomic: two processes tuning at once never see half a file
        except OSError as exc:
            log.warning("cannot cache the GEMM plan in %s: %s", path, exc)
    _memo[key] = plan
    return plan


_ALONE = threading.local()  # .on: this thread's calls compute each row as it would be alone


@contextmanager
def rows_alone():
    """Within (on this thread): every TunedLinear call goes through one of our row-invariant
    kernels, which compute each row with the bits it gets alone, at any row count; the plan is set
    aside. Per weight the kernel is fixed for the model's life: the panel kernel where the plan
    already keeps that weight's panel layout (it stays fast at 4-17 rows), else the streaming
    kernel, which reads the weight as stored (no extra memory). For forwards whose numbers must
    equal plain decoding's exactly (a request that asks for logprobs; docs/history.md, "A
    batch-invariant decode path"). The caller checks that the streaming kernel loads
    (`gemv.library()`); a panel layout exists only where the panel kernel loaded."""
    before = getattr(_ALONE, "on", False)
    _ALONE.on = True
    try:
        yield
    finally:
        _ALONE.on = before


class TunedLinear:
    """A linear layer's weight `# [out, in]`, applied as x @ W.T `# [n, in] -> [n, out]` through the
    plan's path for its shape and the call's row count. Holds only the layouts its plan uses."""

    def __init__(self, w: torch.Tensor, plan: GemmPlan):
        self.w = w.detach().contiguous()  # [out, in]
        self.shape = (self.w.shape[0], self.w.shape[1])
        key = shape_key(self.shape)
        # per slot: (path, rows to compute); the prefill slot's pad is ignored (it never pads)
        self.by_slot = [parse_choice(entry, SLOTS[i]) for i, entry in enumerate(plan.choice[key])]
        self.layouts = {p: prepare(self.w, p) for p, _ in self.by_slot}
        self._calls = [bind(p, self.layouts[p]) for p, _ in self.by_slot]  # per slot
        # the row-invariant kernel of `rows_alone` for this weight (see there)
        self.alone = GemmPath.tandem_panel if GemmPath.tandem_panel in self.layouts else GemmPath.tandem_gemv
        self._alone_call = bind(self.alone, self.layouts.get(self.alone, self.w))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if getattr(_ALONE, "on", False):
            return self._alone_call(x)
        slot = slot_of(n)
        rows = self.by_slot[slot][1]
        if rows > n and n <= ROWS[-1]:  # zero rows: each output row depends on its own input row only
            return self._calls[slot](torch.cat([x, x.new_zeros(rows - n, x.shape[1])]))[:n]
        return self._calls[slot](x)
