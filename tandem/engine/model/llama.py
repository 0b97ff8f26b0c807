"""A native forward for the Llama family (Llama, Mistral, Qwen2, SmolLM), built for verification.

Why not `transformers`' own forward: speculative verification runs many short blocks (1-17 tokens)
on top of a long KV cache, and on a CPU three costs of the generic forward dominate there:
- GEMMs of a few rows: how close they get to memory speed depends on the library path and the CPU
  (on an AMD EPYC, MKL's `F.linear` reads the LM head at ~11 GB/s for 1 row and 2-3x slower again
  for 2-3 rows; oneDNN with a packed weight stays near memory speed for 1-17 rows). Every float32
  weight on a CPU goes through the path measured fastest on this machine for its shape and row
  count (tandem.engine.model.gemm, with the rule that keeps this lossless);
- a KV cache that grows by concatenation copies the whole cache every step;
- per-module Python overhead (hundreds of small calls per forward).
So the weights are re-laid out once (fused QKV and gate/up projections, each in its GEMM path's
layout, the LM head in vocabulary chunks), the cache is preallocated and written in place, and
rolling back is just moving a length.

The same checkpoints load (the weights are taken from the `transformers` model), and tests compare
logits with `transformers` on identical inputs.
"""

from __future__ import annotations

import collections
import ctypes

import functools
import math
import threading
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from tandem.engine.model.gemm import SLOTS, GemmPath, GemmPlan, TunedLinear, median_seconds, parse_choice, plan_for
from tandem.engine.native import attend, gemv, panel, quant, rowops
from tandem.engine.native.quant import QuantizedLinears

SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


class Unsupported(ValueError):
    pass


def check_supported(model: torch.nn.Module) -> None:
    """Raise Unsupported (with the reason) unless `model` can run natively."""
    arch = type(model).__name__
    cfg = model.config
    if arch not in SUPPORTED:
        raise Unsupported(f"architecture {arch} is not in the native Llama family {sorted(SUPPORTED)}")
    scaling = getattr(cfg, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", rope_type) if isinstance(params, dict) else rope_type
    if rope_type not in ("default", None):
        raise Unsupported(f"RoPE scaling {rope_type!r} is not implemented natively")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", arch == "MistralForCausalLM"):
        raise Unsupported("sliding-window attention is not implemented natively")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise Unsupported(f"activation {cfg.hidden_act!r} is not implemented natively")


def rope_theta(cfg) -> float:
    """RoPE base of a Llama-family config (transformers 5 keeps it in rope_parameters)."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


class KVPool:
    """Keys and values of many sequences in one buffer each, `# [layers, kv_heads, slots, head_dim]`,
    so that one forward writes every row's KV with one call a layer and gathers every sequence's
    context with one more (`_PooledAttention`). Why: on a GPU each call is a kernel launch, and with a
    cache tensor per sequence the KV writes and attention cost about five launches a row a layer:
    ~6 ms a row a forward on an H200 with the default model (docs/benchmarks.md, "On a GPU").

    A sequence owns one contiguous region of slots, which its KVCache views as its own
    `# [layers, kv_heads, capacity, head_dim]` (so every per-sequence operation works unchanged).
    Regions are first fit from a sorted free list and merged when freed. A region is freed when its
    cache is dropped; the finalizer may run inside the garbage collector on any thread, even in the
    middle of an `alloc`, so it only queues the region (a deque append is atomic) and the queue is
    drained under the lock by the next alloc."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, slots: int):
        if slots < 1:
            raise ValueError(f"a KV pool needs at least one slot, not {slots}")
        with torch.inference_mode(False):  # written by forwards, read by anything, like a cache's own
            self.k = torch.empty(layers, kv_heads, slots, head_dim, dtype=dtype, device=device)
            self.v = torch.empty_like(self.k)
        self._free: list[tuple[int, int]] = [(0, slots)]  # (start, length), sorted by start, never adjacent
        self._released: collections.deque[tuple[int, int]] = collections.deque()
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        """The start of a free region of `n` slots (now owned by the caller), or None when no free
        region is that long."""
        with self._lock:
            self._drain()
            for i, (start, length) in enumerate(self._free):
                if length >= n:
                    self._free[i:i + 1] = [(start + n, length - n)] if length > n else []
                    return start
            return None

    def release(self, start: int, n: int) -> None:
        """Give a region back (safe from a finalizer: it is only queued here)."""
        self._released.append((start, n))

    def free_slots(self) -> int:
        with self._lock:
            self._drain()
            return sum(length for _, length in self._free)

    def regions(self) -> list[tuple[int, int]]:
        """The free regions, (start, length) sorted by start (for tests and logs)."""
        with self._lock:
            self._drain()
            return list(self._free)

    def _drain(self) -> None:
        while self._released:
            start, n = self._released.popleft()
            free = self._free
            i = 0
            while i < len(free) and free[i][0] < start:
                i += 1
            if (i > 0 and free[i - 1][0] + free[i - 1][1] > start) or (i < len(free) and start + n > free[i][0]):
                raise RuntimeError(f"KV pool: region ({start}, {n}) released twice or never allocated")
            free.insert(i, (start, n))
            if i + 1 < len(free) and start + n == free[i + 1][0]:  # merge with the next
                free[i:i + 2] = [(start, n + free[i + 1][1])]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == start:  # and with the previous
                free[i - 1:i + 1] = [(free[i - 1][0], free[i - 1][1] + free[i][1])]


class KVPrefix:
    """The first `length` positions of some cache's keys and values, read by other caches in place
    of a copy of their own: k, v `# [layers, kv_heads, cap, head_dim]` (the whole storage they
    live in; positions past `length` are not this prefix's). Its tensors stay alive while any
    cache holds it, so the cache it came from may be dropped."""

    __slots__ = ("k", "v", "length")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int):
        self.k, self.v, self.length = k, v, length


class KVCache:
    """Preallocated keys and values of one sequence: `# [layers, kv_heads, capacity, head_dim]`.

    `length` is the number of valid positions; rollback only lowers it (entries past it are garbage
    and are overwritten by the next forward). Capacity doubles when exceeded. With a `pool`, `k` and
    `v` are views of one region of the pool's buffers (`base` its first slot); when the pool has no
    room (at first or when growing), the cache holds tensors of its own (`pool` None) and works
    the same, its rows taking the per-sequence path of the forward.

    A shared prefix (`prefix`, CPU caches outside a pool): positions 0 .. off-1 are another cache's
    (`KVPrefix`, read in place by the attention) and `k`/`v` hold position p at slot p - off. Why:
    64 agent sessions of one tenant each held a copy of the same 1,260-token tool list, 64 x 1,260
    of the 93k tokens they wanted against a budget of 65,536, so they ran in waves
    (docs/benchmarks.md, "Many agent sessions"). `off` is a multiple of attend.SPAN, so the kernel
    reads the same keys in the same runs as from one cache: the same bits (tested). Positions a
    cache lent out (`frozen`: slots 0 .. frozen-1 of its own storage) are never written again:
    a rollback below them or a growth moves the cache to new storage and leaves the old to its
    readers (`_detach`, `ensure`).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, capacity: int = 256,
                 pool: KVPool | None = None):
        self.pool: KVPool | None = None
        self.base = 0
        self._region: weakref.finalize | None = None
        self.length = 0
        self.prefix: KVPrefix | None = None
        self.off = 0  # positions held by `prefix`
        self.frozen = 0  # slots of k/v that other caches read as their prefix
        if pool is None or not self._take(pool, capacity):
            self.k = torch.empty(layers, kv_heads, capacity, head_dim, dtype=dtype, device=device)
            self.v = torch.empty_like(self.k)

    def _take(self, pool: KVPool, capacity: int) -> bool:
        """Move into a new region of `pool` of `capacity` slots, keeping the valid positions."""
        base = pool.alloc(capacity)
        if base is None:
            return False
        with torch.inference_mode(False):  # plain views, as plain as a cache's own tensors
            k = pool.k[:, :, base:base + capacity]  # [layers, kv_heads, capacity, head_dim] views
            v = pool.v[:, :, base:base + capacity]
        if self.length:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self._give_back()
        self.k, self.v, self.pool, self.base = k, v, pool, base
        self._region = weakref.finalize(self, pool.release, base, capacity)
        return True

    def _give_back(self) -> None:
        if self._region is not None:
            self._region()  # releases the old region now, once
            self._region = None

    def _own_storage(self, capacity: int, keys: torch.Tensor | None = None, values: torch.Tensor | None = None) -> None:
        """New tensors of our own of `capacity` slots, the first ones holding `keys` and `values`
        `# [layers, kv_heads, n, head_dim]` (e.g. `read`'s views of the old tensors; none: empty)."""
        like = self.k
        self.k = torch.empty(like.shape[0], like.shape[1], capacity, like.shape[3], dtype=like.dtype, device=like.device)
        self.v = torch.empty_like(self.k)
        if keys is not None:
            self.k[:, :, : keys.shape[2]] = keys
            self.v[:, :, : values.shape[2]] = values

    def ensure(self, needed: int) -> None:
        cap = self.k.shape[2]
        if needed - self.off <= cap:
            return
        if self.frozen:  # other caches read our first slots: they stay theirs, and become our prefix too
            keys, values = self.read(self.frozen, self.length)
            self.prefix, self.off, self.frozen = KVPrefix(self.k, self.v, self.frozen), self.frozen, 0
            self._own_storage(max(needed - self.off, 2 * max(keys.shape[2], 1), 256), keys, values)
            return
        new_cap = max(needed - self.off, 2 * cap)
        if self.pool is not None and self._take(self.pool, new_cap):
            return
        self._own_storage(new_cap, *self.read(self.off, self.length))
        # a pool without room: continue with tensors of our own (the region goes back after the copy)
        self._give_back()
        self.pool = None

    def get_seq_length(self) -> int:
        return self.length

    def crop_to(self, length: int) -> None:
        if length < self.length and (length < self.off or length < self.frozen):
            self._detach(length)
        self.length = min(self.length, length)

    def _detach(self, length: int) -> None:
        """Before positions below what others read (or below our prefix) are written again: keep
        the first `length` positions in storage nobody else reads (the prefix shortened to whole
        kernel runs where it reaches that far)."""
        shared = length // attend.SPAN * attend.SPAN if self.prefix is not None else 0
        keys, values = self.read(shared, length)
        self.prefix = KVPrefix(self.prefix.k, self.prefix.v, shared) if shared else None
        self.off, self.frozen = shared, 0
        self._own_storage(max(self.k.shape[2], length - shared), keys, values)

    def read(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions a .. b-1 (< length), `# [layers, kv_heads, b - a, head_dim]`
        each: views where they lie in one storage, else a copy."""
        off = self.off
        if a >= off:
            return self.k[:, :, a - off : b - off], self.v[:, :, a - off : b - off]
        if b <= off:
            return self.prefix.k[:, :, a:b], self.prefix.v[:, :, a:b]
        return (torch.cat([self.prefix.k[:, :, a:off], self.k[:, :, : b - off]], dim=2),
                torch.cat([self.prefix.v[:, :, a:off], self.v[:, :, : b - off]], dim=2))

    def take_prefix(self, src: "KVCache", length: int, share: bool = True) -> None:
        """Become the first `length` positions of `src` (anything held before is dropped). With
        `share` (and both caches outside a pool), the whole kernel runs of them are read from
        src's storage in place (`KVPrefix`) and only the rest is copied."""
        shared = 0
        if share and self.pool is None and src.pool is None and length >= attend.SPAN:
            if src.prefix is not None:
                shared = min(src.off, length // attend.SPAN * attend.SPAN)
                prefix = KVPrefix(src.prefix.k, src.prefix.v, shared)
            else:
                shared = length // attend.SPAN * attend.SPAN
                src.frozen = max(src.frozen, shared)
                prefix = KVPrefix(src.k, src.v, shared)
        keys, values = src.read(shared, length)
        if shared:
            if self.frozen or self.k.shape[2] < length - shared:  # others read our storage, or it is short
                self._own_storage(max(256, 2 * (length - shared)))
            self.prefix, self.off, self.frozen, self.length = prefix, shared, 0, shared
        else:
            if self.off or self.frozen:  # our storage may be read by others, or hold no position 0
                self.prefix, self.off, self.frozen = None, 0, 0
                self._own_storage(max(self.k.shape[2], length))
            self.length = 0
            self.ensure(length)
        self.k[:, :, self.length - self.off : length - self.off] = keys
        self.v[:, :, self.length - self.off : length - self.off] = values
        self.length = length


class _PlainWeight:
    """A linear layer's weight `# [out, in]` on a GPU or in a dtype other than float32 (the GEMM
    tuner measures float32 CPU paths only), applied as x @ W.T `# [n, in] -> [n, out]`: one path for
    every row count (cuBLAS has no small-row cliff to route around)."""

    def __init__(self, w: torch.Tensor):
        self.w = w.detach().contiguous()  # [out, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


class _Int8Weight:
    """A linear layer's weight `# [out, in]` in int8 with one scale per output row
    (`panel.quantize_int8`): for a draft model on a CPU only.

    Why: a draft step reads every weight for one token, so it is bound by memory, not arithmetic
    (2 layers and an 8,192-row head of SmolLM2's width are 47 MB in float32: ~1.8 ms a step, measured,
    which is 6% of a target step and paid on every look at the draft). int8 reads a quarter of
    that. Rounding changes the draft's numbers slightly; that can change which tokens it proposes,
    never what is committed: the target verifies every draft in full precision.

    Three kernels: our int8 panels (`panel.PackedInt8Weight`, AVX-512, float32 activations), the
    same int8 values as Q8_0 blocks on quant.c's int8-activation kernel (every block of a row with
    the row's scale; activations rounded to 8 bits per block, integer dot products: AVX-512 VNNI or
    AVX2), and torch's weight-packed int8 matmul (bfloat16 activations, a private op: checked, never
    assumed). Where several run, the fastest for this shape at one row (a draft's usual step) is
    measured once per process and shape and kept (`CHOSEN`): on the EPYC host our panels took
    0.55-0.65x torch's time on every SmolLM2 shape at 1-9 rows, and the blocks less again.
    """

    CHOSEN: dict[tuple[int, int, int], str] = {}  # (out, in, threads) -> "panel" | "blocks" | "torch"

    def __init__(self, w: torch.Tensor):
        q, scale = panel.quantize_int8(w)  # [out, in] int8, [out]
        self.q = q.contiguous()
        self.scale = scale.to(torch.bfloat16)  # [out], torch's kernel's dtype
        self._panel = panel.PackedInt8Weight(q, scale) if panel.library() is not None else None
        self._blocks = None
        if q.shape[1] % quant.BLOCK == 0 and quant.int8_activations_available():
            # [out, in/32]; the scale rounded to float16, which that layout keeps (a draft's numbers only)
            d = scale.half().float()[:, None].expand(-1, q.shape[1] // quant.BLOCK).contiguous()
            self._blocks = quant.QuantizedWeight(quant.QuantRows("Q8_0", self.q, d, torch.zeros_like(d)), "int8")
        self._kernels = {"panel": self._panel, "blocks": self._blocks,
                         "torch": self._torch if self.torch_available() else None}
        self.kernel = self._choose()
        self._fn = self._kernels[self.kernel]
        # only the chosen kernel's copy is kept
        self._kernels = self._panel = self._blocks = None
        if self.kernel != "torch":
            self.q = None

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, in] -> [n, out], in x's dtype
        return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.q, self.scale).to(x.dtype)

    def _choose(self) -> str:
        runs = [k for k, fn in self._kernels.items() if fn is not None]
        if len(runs) == 1:
            return runs[0]
        key = (*self.q.shape, torch.get_num_threads())
        if key not in self.CHOSEN or self.CHOSEN[key] not in runs:
            x = torch.randn(1, self.q.shape[1])
            self.CHOSEN[key] = min(runs, key=lambda k: median_seconds(lambda: self._kernels[k](x), 15))
        return self.CHOSEN[key]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, in] -> [n, out], in x's dtype
        return self._fn(x).to(x.dtype)

    @staticmethod
    @functools.cache
    def torch_available() -> bool:
        """Whether this torch build has the CPU int8 kernel (a private op: checked, never assumed)."""
        try:
            q = torch.ones(8, 32, dtype=torch.int8)
            y = torch._weight_int8pack_mm(torch.ones(1, 32, dtype=torch.bfloat16), q, torch.ones(8, dtype=torch.bfloat16))
            return bool(torch.isfinite(y).all())
        except (AttributeError, RuntimeError, NotImplementedError):
            return False

    @staticmethod
    def available() -> bool:
        """Whether some int8 kernel runs here (ours or torch's)."""
        return panel.library() is not None or _Int8Weight.torch_available()


class _FusedAttention:
    """One forward's rotary embedding, cache write and attention on our kernels (rowops.rope_store,
    attend.attend), for every block and layer. Layer 0 goes through the checked wrappers; the other
    layers repeat the same calls with the same layout (the same buffers and caches, the layer's
    slice of each cache found by its stride), straight to the libraries: a one-token step makes 60 of
    these calls, and the checks, slices and views cost more than the kernels at short contexts.

    Why raw calls are safe here: every pointer is one the layer-0 call checked, moved by whole
    layers inside the same cache tensor (`ensure` ran before the forward, so no cache reallocates
    during it), and `qkv` is each layer's fresh GEMM output of the same shape, checked per call."""

    def __init__(self, model: NativeLlama, blocks, offsets, starts, bits, cos2, sin2, att, kernel, masks):
        # cos2, sin2 `# [N, D]`, att `# [N, H D]`: the forward's; q `# [N, H, D]` written per layer.
        # kernel[b]: block b's attention on attend.c; otherwise (a prompt piece longer than it
        # serves) torch's scaled_dot_product_attention with masks[b] `# [n, s + n]` (None: all keys),
        # as the unfused path computes it, so a step that carries a prompt piece beside decoding rows
        # keeps those rows on the fused path (its per-block torch calls cost ~20 ms at 64 sessions).
        self.H, self.KV, self.D = model.n_heads, model.n_kv, model.head_dim
        self.scale, self.att, self.cos2, self.sin2 = model.scale, att, cos2, sin2
        self.q = torch.empty(att.shape[0], self.H, self.D, dtype=att.dtype)
        self.blocks = [(offsets[b], offsets[b + 1], starts[b], cache, bits[b]) for b, (_, cache) in enumerate(blocks)]
        self.torch_blocks = [(b, offsets[b], offsets[b + 1], starts[b], cache, masks[b])
                             for b, (_, cache) in enumerate(blocks) if not kernel[b]]
        self.kernel = kernel
        self.width = (self.H + 2 * self.KV) * self.D  # qkv's row length
        self.rope, self.attn = rowops.library(), attend.library()
        self.threads = torch.get_num_threads()
        self.half = int(model.kv_dtype == torch.float16)  # the caches' keys and values in float16
        # Each block's layers (first, end) where a prompt piece runs through some only (set by the
        # forward); None: every block through every layer. A block outside its layers writes no KV
        # and attends to nothing at that layer.
        self.spans: list[tuple[int, int]] | None = None
        # Several blocks on attend.c (a batched step's sessions): layers after the first make one
        # call for all of them (`tandem_attend_many`, one parallel region; same bits as a call a
        # block). Their descriptors are set at layer 0, once its checked calls passed.
        self.many = [b for b, use in enumerate(kernel) if use]
        self.desc: np.ndarray | None = None  # `# [len(many), 14]` int64, attend.DESC_FIELDS
        self.pk0: np.ndarray | None = None  # the shared prefixes' layer-0 addresses (0: none), where any
        # and the rotary's and cache writes' of every block (`tandem_rope_store_many`): `# [blocks, 6]`
        # int64 (first row, rows, k, v, capacity, start)
        self.rope_desc: np.ndarray | None = None

    def __call__(self, li: int, qkv: torch.Tensor) -> None:
        # qkv `# [N, (H + 2 KV) D]` contiguous, this layer's
        H, KV, D = self.H, self.KV, self.D
        act = None if self.spans is None else np.array([a <= li < e for a, e in self.spans])  # `# [blocks]` bool
        if li == 0:
            for b, ((a, e, s, cache, tree), use) in enumerate(zip(self.blocks, self.kernel)):
                if act is not None and not act[b]:
                    continue
                rowops.rope_store(qkv[a:e], self.cos2[a:e], self.sin2[a:e], self.q[a:e], cache.k[0], cache.v[0],
                                  s - cache.off)
                if use:
                    attend.attend(self.q[a:e], cache.k[0], cache.v[0], self.att[a:e], s, self.scale, tree,
                                  _prefix_at(cache, 0))
            self._torch_attention(0, act)
            if len(self.many) > 1:
                self._describe()
            return
        if qkv.shape != (self.q.shape[0], self.width) or not qkv.is_contiguous() or qkv.dtype != torch.float32:
            raise ValueError(f"layer {li}'s qkv {tuple(qkv.shape)} is not the layout layer 0 was checked with")
        f = 4  # bytes per float32
        qkv_p, q_p, att_p = qkv.data_ptr(), self.q.data_ptr(), self.att.data_ptr()
        cos_p, sin_p = self.cos2.data_ptr(), self.sin2.data_ptr()
        if self.desc is not None:  # every block's rotary and cache writes, then every attend.c block, in one call each
            k_p = self.k0 + li * self.k_step  # `# [blocks]`: each block's layer li of its cache
            v_p = self.v0 + li * self.v_step
            rd, desc = self.rope_desc, self.desc
            rd[:, 2], rd[:, 3] = k_p, v_p
            desc[:, 1], desc[:, 2] = k_p[self.many], v_p[self.many]
            if self.pk0 is not None:  # blocks with a shared prefix: its layer li (0 stays 0: none)
                desc[:, 10] = np.where(self.pk0 != 0, self.pk0 + li * self.pk_step, 0)
                desc[:, 11] = np.where(self.pv0 != 0, self.pv0 + li * self.pv_step, 0)
            if act is not None:  # only the blocks inside their layers (copies: the arrays stay whole)
                rd, desc = np.ascontiguousarray(rd[act]), np.ascontiguousarray(desc[act[self.many]])
            self.rope.tandem_rope_store_many(len(rd), rd.ctypes.data, qkv_p, self.width, H, KV, D, cos_p, sin_p, q_p,
                                             self.half)
            rc = self.attn.tandem_attend_many(len(desc), desc.ctypes.data, H, KV, D, self.scale, self.threads,
                                              self.half)
            if rc != 0:
                raise MemoryError(f"the CPU attention kernel failed ({rc})")
        else:
            for b, ((a, e, s, cache, tree), use) in enumerate(zip(self.blocks, self.kernel)):
                if act is not None and not act[b]:
                    continue
                k_p = cache.k.data_ptr() + li * cache.k.stride(0) * cache.k.element_size()
                v_p = cache.v.data_ptr() + li * cache.v.stride(0) * cache.v.element_size()
                self.rope.tandem_rope_store(qkv_p + a * self.width * f, self.width, e - a, H, KV, D, cos_p + a * D * f,
                                            sin_p + a * D * f, q_p + a * H * D * f, k_p, v_p, cache.k.shape[2],
                                            s - cache.off, self.half)
                if not use:
                    continue
                pre = cache.prefix
                pk_p = 0 if pre is None else pre.k.data_ptr() + li * pre.k.stride(0) * pre.k.element_size()
                pv_p = 0 if pre is None else pre.v.data_ptr() + li * pre.v.stride(0) * pre.v.element_size()
                rc = self.attn.tandem_attend(q_p + a * H * D * f, H * D, k_p, v_p, att_p + a * H * D * f, H * D, H, KV,
                                             e - a, D, s, cache.k.shape[2], self.scale, self.threads,
                                             None if tree is None else ctypes.addressof(tree), self.half,
                                             pk_p, pv_p, 0 if pre is None else pre.k.shape[2], cache.off)
                if rc != 0:
                    raise MemoryError(f"the CPU attention kernel failed ({rc})")
        self._torch_attention(li, act)

    def _describe(self) -> None:
        """The descriptors of every block's rotary and cache writes (`tandem_rope_store_many`) and
        of the blocks on attend.c (`tandem_attend_many`, `attend.describe`), at layer 0's addresses:
        the tensors its checked calls used. Later layers move k and v by whole layers of their
        caches (k0 + li * k_step)."""
        self.rope_desc = np.array([[a, e - a, cache.k.data_ptr(), cache.v.data_ptr(), cache.k.shape[2], s - cache.off]
                                   for a, e, s, cache, _ in self.blocks], dtype=np.int64)
        self.desc = np.array([attend.describe(self.q[a:e], cache.k[0], cache.v[0], self.att[a:e], s, tree,
                                              _prefix_at(cache, 0))
                              for a, e, s, cache, tree in (self.blocks[b] for b in self.many)], dtype=np.int64)
        prefixed = [self.blocks[b][3].prefix for b in self.many]
        if any(p is not None for p in prefixed):
            self.pk0, self.pv0 = self.desc[:, 10].copy(), self.desc[:, 11].copy()
            self.pk_step = np.array([0 if p is None else p.k.stride(0) * p.k.element_size() for p in prefixed],
                                    dtype=np.int64)
            self.pv_step = np.array([0 if p is None else p.v.stride(0) * p.v.element_size() for p in prefixed],
                                    dtype=np.int64)
        self.k0, self.v0 = self.rope_desc[:, 2].copy(), self.rope_desc[:, 3].copy()
        self.k_step = np.array([c.k.stride(0) * c.k.element_size() for _, _, _, c, _ in self.blocks],
                               dtype=np.int64)  # bytes a layer
        self.v_step = np.array([c.v.stride(0) * c.v.element_size() for _, _, _, c, _ in self.blocks], dtype=np.int64)

    def _torch_attention(self, li: int, act: np.ndarray | None) -> None:
        """Layer li's attention of the blocks attend.c does not serve (their queries and the cache
        already rotated and written), as the unfused path computes it; `act`: which blocks run
        this layer (None: all)."""
        for b, a, e, s, cache, mask in self.torch_blocks:
            if act is None or act[b]:
                self.att[a:e] = _torch_block_attention(self.q[a:e], cache, li, s, mask, self.scale)


def _torch_block_attention(q: torch.Tensor, cache: KVCache, li: int, start: int, mask: torch.Tensor | None,
                           scale: float) -> torch.Tensor:
    """One block's attention on torch's kernel: q `# [n, H, D]` at positions start .. start+n-1 over
    layer li's cache (already holding them), mask `# [n, start + n]` bool or None (every key) ->
    `# [n, H D]`. The fused and the unfused forward both call it, so a block gets the same bits
    on either. A float16 cache is widened to q's float32 first (exact), as attend.c reads it."""
    n, H, D = q.shape
    L = start + n
    if cache.prefix is None:
        k, v = cache.k[li, :, :L], cache.v[li, :, :L]  # [KV, L, D] each
    else:  # the shared prefix's keys, then the cache's own (a copy: torch's kernel takes one tensor)
        off, pre = cache.off, cache.prefix
        k = torch.cat([pre.k[li, :, :off], cache.k[li, :, : L - off]], dim=1)  # [KV, L, D]
        v = torch.cat([pre.v[li, :, :off], cache.v[li, :, : L - off]], dim=1)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
        attn_mask=mask, scale=scale, enable_gqa=H != cache.k.shape[1],
    )[0].transpose(0, 1).reshape(n, H * D)


class _RawLayers:
    """One forward's layers when every step of them runs on our C kernels (the GGUF target on a
    CPU: quant.c's products, rowops.c's norms and gated activation, `_FusedAttention`): the same
    calls on the same inputs in the same order as the checked path, made straight on buffers
    allocated once for the forward. A one-token step makes about 210 such calls; their Python
    wrappers (checks, a fresh output tensor each, the thread count) cost 3-4 us each, ~0.7 ms of
    a ~7 ms step on the Intel host. Same bits as the checked path (tested).

    Why raw calls are safe here: the model's weights and norms were checked once
    (`NativeLlama.raw_layers`), and every buffer is made here with the shapes the kernels read."""

    def __init__(self, model: "NativeLlama", x: torch.Tensor, att: torch.Tensor, attention: _FusedAttention):
        # x `# [N, hidden]` contiguous (the residual stream, updated in place), att `# [N, H D]`
        N, d = x.shape
        if not x.is_contiguous() or x.dtype != torch.float32 or att.shape != (N, model.n_heads * model.head_dim):
            raise ValueError(f"raw layers take a contiguous float32 x [N, {d}], got {tuple(x.shape)} {x.dtype}")
        first = model.layers[0]
        self.inter = first["wdown"].in_features
        self.x, self.att, self.attention = x, att, attention
        self.h = torch.empty(N, d)  # each norm's output, the next product's input
        self.qkv = torch.empty(N, first["wqkv"].out_features)
        self.o = torch.empty(N, d)
        self.gu = torch.empty(N, 2 * self.inter)
        self.act = torch.empty(N, self.inter)
        self.down = torch.empty(N, d)
        self.model = model
        # prompt pieces through some layers only (NativeLlama.forward_batch's `layers`): rows
        # [ra, re) enter at layer `first` with their residual stream (None at layer 0), and leave
        # after layer end - 1, their stream kept in `left[block]`
        self.enter: list[tuple[int, int, int, torch.Tensor | None]] = []
        self.leave: list[tuple[int, int, int, int]] = []
        self.left: dict[int, torch.Tensor] = {}

    def run(self) -> torch.Tensor:
        """The residual stream after the last layer `# [N, hidden]` (before the final norm)."""
        m = self.model
        lib, T, eps = rowops.library(), torch.get_num_threads(), m.eps
        N, d = self.x.shape
        xp, hp, qkvp, op = self.x.data_ptr(), self.h.data_ptr(), self.qkv.data_ptr(), self.o.data_ptr()
        gup, actp, downp, attp = self.gu.data_ptr(), self.act.data_ptr(), self.down.data_ptr(), self.att.data_ptr()
        for li, w in enumerate(m.layers):
            for ra, re, first, hid in self.enter:
                if first == li and hid is not None:
                    # x + (-0.0) is x exactly, -0.0 included: the add below leaves the stream as it
                    # was handed back, as a piece's unsplit forward would have it here
                    self.x[ra:re] = hid
                    self.down[ra:re] = -0.0
            if li == 0:
                lib.tandem_rms_norm(xp, d, w["in_norm"].data_ptr(), hp, d, N, d, eps, T)
            else:  # x += the previous layer's MLP output, then its norm (one call)
                lib.tandem_add_rms_norm(xp, downp, w["in_norm"].data_ptr(), hp, N, d, eps, T)
            w["wqkv"].raw(hp, qkvp, N, T)
            self.attention(li, self.qkv)  # writes att
            w["wo"].raw(attp, op, N, T)
            lib.tandem_add_rms_norm(xp, op, w["post_norm"].data_ptr(), hp, N, d, eps, T)
            w["wgu"].raw(hp, gup, N, T)
            lib.tandem_silu_mul(gup, actp, N, self.inter, T)
            w["wdown"].raw(actp, downp, N, T)
            for ra, re, end, b in self.leave:
                if end == li + 1 and end < len(m.layers):  # the same add the next layer's norm would make
                    self.left[b] = self.x[ra:re] + self.down[ra:re]
        return self.x + self.down


# A GPU's KV pool: at most this share of the device's free memory when the first cache is made,
# and at most this many slots (SmolLM2-135M in float32: 46 KB a slot, 262,144 slots = 12 GB).
KV_POOL_MEMORY_FRACTION = 0.10
KV_POOL_MAX_SLOTS = 1 << 18
# Blocks up to this many rows share one attention call a layer (`_PooledAttention`); a longer block
# (a prefill piece) keeps its own: its attention is real work beside one launch, and padding every
# row of the batch to its length would multiply the others' work.
POOLED_MAX_ROWS = 64


def default_kv_pool_slots(device, bytes_per_slot: int) -> int:
    """Slots of the KV pool a model on `device` gets by default: on a GPU, KV_POOL_MEMORY_FRACTION
    of its free memory (at most KV_POOL_MAX_SLOTS); elsewhere none (a CPU forward's own attention
    kernel reads each sequence's cache in place, and per-call costs there are small)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    free = torch.cuda.mem_get_info(device)[0]
    return int(min(KV_POOL_MAX_SLOTS, free * KV_POOL_MEMORY_FRACTION // bytes_per_slot))


class _PooledAttention:
    """One forward's KV writes and attention for the blocks whose caches live in the model's KV
    pool, with the same number of calls a layer for any number of blocks: the new keys and values
    of every row land with one `index_copy_` each, every block's context is gathered with one
    `index_select` each into `# [B, KV, T, D]` (T the longest context, shorter ones padded and
    masked), and one `scaled_dot_product_attention` runs over the padded batch. Index tensors and
    the mask are built on the host once per forward and moved in two copies.

    The arithmetic is each block's own attention over its own keys; padded keys are masked out and
    padded query rows are dropped. Which kernel torch picks for the padded batch can differ from a
    lone block's, so results may differ from the per-block path in the last bits, as the GEMMs'
    do with the batch's row count on a GPU (docs/history.md, "KV pool on a GPU")."""

    def __init__(self, model: "NativeLlama", pool: KVPool, blocks, members: list[int], offsets: list[int],
                 starts: list[int], lens: list[int], trees: list):
        self.H, self.KV, self.D, self.scale = model.n_heads, model.n_kv, model.head_dim, model.scale
        self.pool = pool
        B = len(members)
        Q = max(lens[b] for b in members)
        T = max(starts[b] + lens[b] for b in members)
        self.shape = (B, Q, T)
        slots, rows, qidx, opos = [], [], [], []
        mask = torch.zeros(B, Q, T, dtype=torch.bool)  # [B, Q, T]: query row r of block i sees key t
        for i, b in enumerate(members):
            cache, s, n, a = blocks[b][1], starts[b], lens[b], offsets[b]
            slots.extend(range(cache.base + s, cache.base + s + n))
            rows.extend(range(a, a + n))
            qidx.extend(a + min(r, n - 1) for r in range(Q))  # padded rows repeat the last: dropped
            opos.extend(range(i * Q, i * Q + n))
            if trees[b] is None:
                mask[i, :n, : s + n] = torch.ones(n, s + n, dtype=torch.bool).tril(diagonal=s)
            else:
                mask[i, :n, : s + n] = _tree_mask(trees[b], s, "cpu")
            mask[i, n:, 0] = True  # a padded query row needs one key (no all-masked row, no NaN)
        bases = torch.tensor([blocks[b][1].base for b in members], dtype=torch.long)  # [B]
        last = torch.tensor([starts[b] + lens[b] - 1 for b in members], dtype=torch.long)  # [B]
        # [B, T]: block i's key t at its slot; past its context, its last slot again (masked)
        gidx = bases[:, None] + torch.minimum(torch.arange(T)[None, :], last[:, None])
        in_order = rows == list(range(offsets[-1]))
        flat = torch.tensor(slots + rows + qidx + opos, dtype=torch.long)
        flat = torch.cat([flat, gidx.flatten()]).to(model.device)
        parts = flat.split([len(slots), len(rows), len(qidx), len(opos), B * T])
        self.slots, self.out_rows, self.qidx, self.opos, self.gidx = parts
        # the members' rows of the forward; None: all of them, in order (no gather of the new keys)
        self.rows = None if in_order else self.out_rows
        self.mask = mask[:, None].to(model.device)  # [B, 1, Q, T], broadcast over heads

    def __call__(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, att: torch.Tensor) -> None:
        # q `# [N, H, D]`, k and v `# [KV, N, D]` (this layer's, rotated); writes att `# [N, H D]` at
        # the member blocks' rows
        H, KV, D = self.H, self.KV, self.D
        B, Q, T = self.shape
        pk, pv = self.pool.k[li], self.pool.v[li]  # [KV, slots, D] each
        if self.rows is not None:
            k, v = k.index_select(1, self.rows), v.index_select(1, self.rows)
        pk.index_copy_(1, self.slots, k.to(pk.dtype))  # a float16 pool: rounded once, as the other paths do
        pv.index_copy_(1, self.slots, v.to(pv.dtype))
        kg = pk.index_select(1, self.gidx).view(KV, B, T, D).transpose(0, 1).to(q.dtype)  # [B, KV, T, D]
        vg = pv.index_select(1, self.gidx).view(KV, B, T, D).transpose(0, 1).to(q.dtype)  # [B, KV, T, D]
        qp = q.index_select(0, self.qidx).view(B, Q, H, D).transpose(1, 2)  # [B, H, Q, D]
        o = F.scaled_dot_product_attention(qp, kg, vg, attn_mask=self.mask, scale=self.scale,
                                           enable_gqa=H != KV)  # [B, H, Q, D]
        o = o.transpose(1, 2).reshape(B * Q, H * D)  # [B Q, H D]
        att.index_copy_(0, self.out_rows, o.index_select(0, self.opos))


class NativeLlama:
    """Inference-only Llama-family forward over the weights of a `transformers` model."""

    # Vocabulary rows per LM-head GEMM. Chunks once kept MKL off its compute-bound path for 3+ rows
    # (whole head at 9 rows: 24-32 ms vs 7 ms in 1,024-row chunks); with the measured GEMM paths
    # 8,192-row chunks are 1-3 ms faster a step than 1,024 on the EPYC host (fewer calls), and any
    # path that falls off a cliff at that shape loses the measurement.
    LM_HEAD_CHUNK = 8192
    _LINEAR = ("wqkv", "wo", "wgu", "wdown")  # the weights of a layer that are matrix products

    def __init__(self, model: torch.nn.Module, *, int8: bool = False, plan: GemmPlan | None = None,
                 quantized: QuantizedLinears | None = None, kv_pool_slots: int | None = None,
                 kv_dtype: torch.dtype | None = None):
        """`kv_pool_slots`: the size of the KV pool new caches take their regions from (`KVPool`;
        made with the first cache); None: `default_kv_pool_slots` (a share of a GPU's free memory,
        none on a CPU); 0: no pool.

        `int8`: weights in int8 (`_Int8Weight`), for a draft model on a CPU; ignored elsewhere
        or where the kernel is missing (`self.int8` says what was done). `quantized`: the GGUF
        file's quantized weights (`quant.load_gguf_linears`) for the weights it has in a kept kind,
        run by quant.c as they are stored (float32 on a CPU with that kernel only; `self.precision`
        says what was done); the rest as below. Float32 weights on a CPU
        go through the GEMM paths of `plan` (default: `gemm.plan_for` this model's shapes, measured
        once per machine; see tandem.engine.model.gemm for the lossless rule).

        `kv_dtype`: what the KV cache stores. None: float16 for a GGUF target running on our CPU
        kernels (its quantized weights kept, the row and attention kernels built: llama.cpp's default
        cache type too), else the model's dtype. A float16 cache halves what attention reads at long
        contexts; keys and values are rounded once when written and widened exactly when read, so
        plain decoding and verification see the same cache (the target is the model with this
        cache: `precision` says so). float16 needs a float32 model on a CPU."""
        check_supported(model)
        cfg = model.config
        self.config = cfg
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.hidden = cfg.hidden_size
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.n_heads
        self.eps = cfg.rms_norm_eps
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        base = model.model
        self.int8 = int8 and not p.is_cuda and p.dtype == torch.float32 and _Int8Weight.available()
        self.gemm_plan: GemmPlan | None = None  # float32 on a CPU only
        head = model.get_output_embeddings().weight.detach()  # [vocab, hidden]
        head_parts = [head] if self.int8 or head.is_cuda else list(head.split(self.LM_HEAD_CHUNK))
        with torch.no_grad():
            self.embed = base.embed_tokens.weight.detach()  # [vocab, hidden]
            self.layers = []
            for layer in base.layers:
                att, mlp = layer.self_attn, layer.mlp
                wqkv = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight], 0)  # [(H+2KV)D, hidden]
                bqkv = None
                if att.q_proj.bias is not None:
                    bqkv = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias], 0).detach()
                self.layers.append({  # the linear weights as tensors here; wrapped below (_LINEAR)
                    "in_norm": layer.input_layernorm.weight.detach(),  # [hidden]
                    "post_norm": layer.post_attention_layernorm.weight.detach(),  # [hidden]
                    "wqkv": wqkv,  # [(H+2KV)D, hidden]
                    "bqkv": bqkv,
                    "wo": att.o_proj.weight,  # [hidden, H D]
                    "bo": att.o_proj.bias.detach() if att.o_proj.bias is not None else None,
                    "wgu": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0),  # [2I, hidden]
                    "wdown": mlp.down_proj.weight,  # [hidden, I]
                })
            self.final_norm = base.norm.weight.detach()  # [hidden]
            self.vocab = head.shape[0]
            # the GGUF's quantized weights, where this forward can run them (else None: float32)
            keep = (quantized is not None and not self.int8 and not p.is_cuda and p.dtype == torch.float32
                    and quant.library() is not None)
            qrows = [{k: quantized.layers[li][k] if keep else None for k in self._LINEAR}
                     for li in range(self.n_layers)]
            qhead = quantized.head if keep else None
            self.precision = quantized.describe if keep else ("int8 draft" if self.int8 else str(self.dtype).replace("torch.", ""))
            if qhead is not None:
                head_parts = []
            if self.int8:
                lin = _Int8Weight
            elif p.is_cuda or p.dtype != torch.float32:
                lin = _PlainWeight
            else:  # the plan covers exactly the shapes this forward multiplies by in float32
                tensors = [w[k] for w, q in zip(self.layers, qrows) for k in self._LINEAR if q[k] is None] + head_parts
                if tensors:
                    shapes = {tuple(t.shape) for t in tensors}
                    model_bytes = sum(t.numel() * t.element_size() for t in tensors)
                    self.gemm_plan = gemm_plan = plan or plan_for(sorted(shapes), model_bytes)

                def lin(w: torch.Tensor) -> TunedLinear:
                    return TunedLinear(w, gemm_plan)
            for w, q in zip(self.layers, qrows):
                for k in self._LINEAR:
                    w[k] = lin(w[k]) if q[k] is None else quant.QuantizedWeight(q[k], quantized.activations)
            # each [<=chunk, hidden]; one on a GPU, in int8 or quantized
            self.head_chunks = [lin(c) for c in head_parts] if qhead is None else [quant.QuantizedWeight(qhead, quantized.activations)]
            # every GEMM on quant.c (row-invariant), none on the float32 paths
            self.quantized_only = qhead is not None and all(q[k] is not None for q in qrows for k in self._LINEAR)
        theta = rope_theta(cfg)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.device) / self.head_dim))
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.row_kernel = self.device.type == "cpu" and self.dtype == torch.float32 and rowops.library() is not None
        if kv_dtype is None:
            kv_dtype = (torch.float16 if keep and self.row_kernel and attend.serves(1, self.head_dim, self.dtype, self.device)
                        else self.dtype)
        if kv_dtype != self.dtype and not (kv_dtype == torch.float16 and self.dtype == torch.float32 and not p.is_cuda):
            raise ValueError(f"a {kv_dtype} KV cache needs a float32 model on a CPU (float16); this one is {self.dtype} "
                             f"on {self.device}")
        self.kv_dtype = kv_dtype
        if kv_dtype != self.dtype:
            self.precision += f", {str(kv_dtype).replace('torch.', '')} KV"
        self.kv_pool: KVPool | None = None
        self._kv_pool_slots = kv_pool_slots
        self._kv_pool_lock = threading.Lock()

    @property
    def batch_invariant(self) -> bool:
        """Whether every decode and verification block (up to attend.MAX_ROWS rows, several sessions'
        blocks in one call too) computes each row with the bits it would get alone: every GEMM on
        one of our row-invariant kernels (`--gemm tandem_gemv` or `tandem_panel`; the same one
        everywhere, since the two sum in different orders; a quantized weight always on quant.c),
        our attention kernel and our row kernel.
        Then a verification block's logits equal plain decoding's bit for bit, so greedy output and
        logprobs are identical by construction, not only by the shared-path rule
        (docs/history.md)."""
        if not self.row_kernel or not attend.serves(1, self.head_dim, self.dtype, self.device):
            return False
        if self.gemm_plan is None:  # no float32 GEMM: quantized weights (quant.c is row-invariant) or none of ours
            return self.quantized_only
        paths = {parse_choice(entry, SLOTS[i])[0]
                 for entries in self.gemm_plan.choice.values() for i, entry in enumerate(entries)}
        return paths == {GemmPath.tandem_gemv} or paths == {GemmPath.tandem_panel}

    @functools.cached_property
    def raw_layers(self) -> bool:
        """Whether fused forwards (decode and verification blocks on our kernels) run their layers
        as raw calls (`_RawLayers`): every product on quant.c, the row kernels built, no biases,
        and every weight and norm of the shapes and layout the raw calls assume (checked here,
        once for the model's life)."""
        if not (self.quantized_only and self.row_kernel):
            return False
        d, width = self.hidden, (self.n_heads + 2 * self.n_kv) * self.head_dim
        inter = self.layers[0]["wdown"].in_features
        shapes = {"wqkv": (width, d), "wo": (d, self.n_heads * self.head_dim), "wgu": (2 * inter, d),
                  "wdown": (d, inter)}
        for w in self.layers:
            if w["bqkv"] is not None or w["bo"] is not None:
                return False
            for key, shape in shapes.items():
                lin = w[key]
                if not isinstance(lin, quant.QuantizedWeight) or (lin.out_features, lin.in_features) != shape:
                    return False
            for key in ("in_norm", "post_norm"):
                t = w[key]
                if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != (d,) or t.device.type != "cpu":
                    return False
        return True

    @property
    def splits_layers(self) -> bool:
        """Whether a prompt piece can run through some of the layers per forward (`forward_batch`'s
        `layers`): on the raw layer calls only."""
        return self.raw_layers

    @functools.cached_property
    def can_run_rows_alone(self) -> bool:
        """Whether a forward under `gemm.rows_alone()` is batch-invariant whatever the plan: our
        streaming kernel, attention and row kernels all serve this model on this machine. Fixed
        for the model's life, so asked once (the first request with logprobs builds the kernel)."""
        return ((self.quantized_only or (self.gemm_plan is not None and gemv.library() is not None))
                and self.row_kernel and attend.serves(1, self.head_dim, self.dtype, self.device))

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes one token's keys and values take over all layers."""
        return 2 * self.n_layers * self.n_kv * self.head_dim * self.kv_dtype.itemsize

    @property
    def pools_by_default(self) -> bool:
        """Whether new caches come from a KV pool unless told otherwise (on a GPU)."""
        return default_kv_pool_slots(self.device, self.kv_bytes_per_slot) > 0

    def size_kv_pool(self, slots: int) -> None:
        """Set the KV pool's size (0: none) before the first cache is made, e.g. from a server's KV
        budget; afterwards the pool exists and its size is fixed (RuntimeError)."""
        if slots < 0:
            raise ValueError(f"a KV pool cannot have {slots} slots")
        with self._kv_pool_lock:
            if self.kv_pool is not None:
                raise RuntimeError("the KV pool was made with the first cache; size it before any cache")
            self._kv_pool_slots = slots

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(self.n_layers, self.n_kv, self.head_dim, self.kv_dtype, self.device, capacity,
                       pool=self._pool())

    def _pool(self) -> KVPool | None:
        if self.kv_pool is None and self._kv_pool_slots != 0:
            with self._kv_pool_lock:
                if self.kv_pool is None and self._kv_pool_slots != 0:
                    slots = self._kv_pool_slots
                    if slots is None:
                        slots = default_kv_pool_slots(self.device, self.kv_bytes_per_slot)
                    self._kv_pool_slots = slots
                    if slots > 0:
                        self.kv_pool = KVPool(self.n_layers, self.n_kv, self.head_dim, self.kv_dtype, self.device,
                                              slots)
        return self.kv_pool

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden] -> [n, hidden]. In float32 as transformers does, then back to the weights'
        # dtype. A step calls this 61 times on a few rows: on a CPU through our row kernel
        # (tandem.engine.native.rowops: ~2 us a call where torch's fused op costs 9-45 us, row-invariant),
        # else torch's fused op, which gives the bits of the spelled-out form (w * x * rsqrt(mean(x^2)
        # + eps), tested) in one call instead of seven.
        if self.row_kernel:
            return rowops.rms_norm(x, w, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def _add_rms(self, x: torch.Tensor, o: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x, o: [n, hidden] -> (x + o, its RMSNorm) each [n, hidden]; o None: (x, its norm). On the row
        # kernel the sum is written into x (the forward's own residual stream) and both come from
        # one call: the same IEEE sum as torch's add, so the same bits, one call fewer per norm.
        if o is None:
            return x, self._rms(x, w)
        if self.row_kernel:
            return x, rowops.add_rms_norm(x, o, w, self.eps)
        x = x + o
        return x, self._rms(x, w)

    def _gated(self, gu: torch.Tensor) -> torch.Tensor:
        # gu: [n, 2 I] (gate, up) -> silu(gate) * up [n, I]; on the row kernel in one call (its own exp:
        # not torch's bits, the same for every row count, which is what plain and speculative
        # decoding need to agree)
        if self.row_kernel:
            return rowops.silu_mul(gu)
        inter = gu.shape[-1] // 2
        return F.silu(gu[:, :inter]) * gu[:, inter:]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each `# [n, 1, D]`, for `_rotate`: the sine's first half negated."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [n, D/2]
        emb = torch.cat([freqs, freqs], -1)  # [n, D]
        half = self.head_dim // 2
        sin = emb.sin()
        sin[:, :half].neg_()
        return emb.cos().to(self.dtype)[:, None], sin.to(self.dtype)[:, None]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """RoPE in transformers' rotate_half convention, x `# [n, heads, D]` -> `# [n, heads, D]`:
        x * cos + cat(-x2, x1) * sin, written as x * cos + roll(x, D/2) * signed_sin, which is the
        same arithmetic (a negation is exact) in three ops instead of seven; q and k in one call."""
        return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """h `# [n, hidden]` -> logits `# [n, vocab]`, in vocabulary chunks."""
        if len(self.head_chunks) == 1:
            return self.head_chunks[0](h)
        return torch.cat([c(h) for c in self.head_chunks], -1)

    @torch.inference_mode()
    def forward_batch(
        self, blocks: list[tuple[list[int], KVCache]], need_logits: list[bool | str] | None = None,
        trees: list[list[int] | None] | None = None,
        layers: list[tuple[int, int, torch.Tensor | None] | None] | None = None,
    ) -> list[torch.Tensor | None]:
        """One forward for the blocks of several sequences (ragged: any lengths, any contexts).

        The tokens of all blocks are flattened into one `[N, hidden]` activation, so every weight
        matrix is read once for the whole batch (where batching wins: a small-batch forward is
        memory-bound); attention runs per sequence against its own cache. Returns each block's
        logits `# [len(block), vocab]`, as `forward` would, or None where `need_logits` says so
        (prefill blocks: the LM head over a long prompt would cost more than the rest), or only the
        last row's `# [1, vocab]` where it says "last" (a draft model catching up on its context).

        `trees[b]`, where given, makes block b a token tree: parents[r] is the block row that row r
        follows (-1 for row 0, the pending token). Row r then sits at position start + its depth and
        attends to the cache and its own ancestors only, so its logits are those of the path that
        leads to it; its KV lands at slot start + r (the caller keeps the accepted path's,
        `keep_path`).

        `layers[b] = (first, end, hidden)`, where given, runs block b (a prompt piece, no logits)
        through layers first .. end - 1 only: `hidden` `# [n, hidden]` is its residual stream after
        layer first - 1 (what this call returned for it then; None when first is 0). Until a call
        runs its last layer, the block's cache keeps its length (its keys and values are written
        layer by layer) and the call returns its residual stream after layer end - 1 in place of
        logits. A piece split over calls gives the cache and logits it gives whole, bit for bit
        (tested): why, and the policy that uses it, in runner.PieceBudget. Raw layer calls only
        (`splits_layers`).
        """
        need = need_logits or [True] * len(blocks)
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        L = self.n_layers
        spans = [(0, L, None) if sp is None else sp for sp in (layers or [None] * len(blocks))]
        split = [b for b, (a, e, _) in enumerate(spans) if (a, e) != (0, L)]
        for b in split:
            a, e, hid = spans[b]
            n = len(blocks[b][0])
            if not (0 <= a < e <= L) or need[b] or (trees and trees[b] is not None) or (a == 0) != (hid is None) or (
                    hid is not None and tuple(hid.shape) != (n, self.hidden)):
                raise ValueError(f"block {b} through layers {a}..{e - 1} of {L}: a prompt piece without logits, "
                                 f"with its residual stream [{n}, {self.hidden}] when it does not start at layer 0")
        lens = [len(ids) for ids, _ in blocks]
        starts = [cache.length for _, cache in blocks]
        for (ids, cache), n in zip(blocks, lens):
            cache.ensure(cache.length + n)
        flat = torch.tensor([t for ids, _ in blocks for t in ids], dtype=torch.long, device=self.device)  # [N]
        trees = trees or [None] * len(blocks)
        depths = [None if t is None else _depths(t, n) for t, n in zip(trees, lens)]
        # made on the host (one copy to a GPU, not a small tensor a block)
        positions = torch.cat([torch.arange(s, s + n) if d is None else torch.tensor(d) + s
                               for s, n, d in zip(starts, lens, depths)]).to(self.device)  # [N]
        cos, sin = self._rope(positions)  # [N, 1, D] each
        # decode and verification blocks go through our CPU attention kernel where it is built
        # (tandem.engine.native.attend: torch's reads a long cache at a third of the memory's speed); a
        # prefill, a GPU or another dtype through torch's, with the block's causal mask
        kernel = [attend.serves(n, D, self.dtype, self.device) for n in lens]
        # blocks whose caches are in the KV pool share the layer's KV writes and attention calls
        # (_PooledAttention; worth it from two blocks: one block's own calls are as few)
        pool = self.kv_pool
        members = [b for b, ((_, cache), n) in enumerate(zip(blocks, lens))
                   if pool is not None and cache.pool is pool and n <= POOLED_MAX_ROWS]
        if len(members) < 2:
            members = []
        for b, (_, cache) in enumerate(blocks):
            if cache.pool is not None:  # a region of the pool is a strided view: not for our CPU kernels
                kernel[b] = False
        member = set(members)
        masks = [
            None if n == 1 or use or b in member else
            torch.ones(n, s + n, dtype=torch.bool, device=self.device).tril(diagonal=s) if t is None else
            _tree_mask(t, s, self.device)
            for b, (s, n, use, t) in enumerate(zip(starts, lens, kernel, trees))
        ]
        bits = [attend.tree_bits(t) if t is not None and use else None for t, use in zip(trees, kernel)]
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        N = offsets[-1]
        # Decode and verification blocks on our kernels: the rotary embedding and the cache write in
        # one call per block and layer (rowops.rope_store, the same arithmetic as the torch ops
        # below), which on a one-token step cost more than the attention itself.
        # fused: every block's rotary embedding and cache write on rowops.c and the layers' glue on
        # our kernels; the blocks attend.c does not serve (prompt pieces) attend through torch inside
        fused = self.row_kernel and not members and all(cache.pool is None for _, cache in blocks)
        if split and not (fused and self.raw_layers):
            raise ValueError("a prompt piece through some layers only runs on the raw layer calls (splits_layers)")
        cos2, sin2 = cos.view(N, D), sin.view(N, D)  # [N, D] each
        x = self.embed[flat]  # [N, hidden]
        # one buffer per forward, rewritten by every layer (its output projection reads it first)
        att = torch.empty(N, H * D, dtype=x.dtype, device=self.device)  # [N, H D]
        fused_calls = _FusedAttention(self, blocks, offsets, starts, bits, cos2, sin2, att, kernel, masks) if fused else None
        hidden_out: dict[int, torch.Tensor] = {}
        if split:
            att.zero_()  # rows before their first layer read it: zeros, not whatever the buffer held
            fused_calls.spans = [(a, e) for a, e, _ in spans]
        pooled = _PooledAttention(self, pool, blocks, members, offsets, starts, lens, trees) if members else None
        down = None  # the previous layer's MLP output, added to the residual stream with the next norm
        layers = self.layers
        if fused and self.raw_layers:
            raw = _RawLayers(self, x, att, fused_calls)
            for b in split:
                a, e, hid = spans[b]
                raw.enter.append((offsets[b], offsets[b + 1], a, hid))
                raw.leave.append((offsets[b], offsets[b + 1], e, b))
            x = raw.run()
            hidden_out = raw.left
            layers = []  # done
        for li, w in enumerate(layers):
            x, h = self._add_rms(x, down, w["in_norm"])
            qkv = w["wqkv"](h)  # [N, (H+2KV)D]
            if w["bqkv"] is not None:
                qkv = qkv + w["bqkv"]
            if fused:
                fused_calls(li, qkv)
            else:
                qk = self._rotate(qkv[:, : (H + KV) * D].view(N, H + KV, D), cos, sin)  # [N, H+KV, D]
                q = qk[:, :H]  # [N, H, D]
                k = qk[:, H:].transpose(0, 1)  # [KV, N, D]
                v = qkv[:, (H + KV) * D :].view(N, KV, D).transpose(0, 1)  # [KV, N, D]
                if pooled is not None:
                    pooled(li, q, k, v, att)
                for b, (_, cache) in enumerate(blocks):
                    if b in member:
                        continue
                    a, e, s = offsets[b], offsets[b + 1], starts[b]
                    at = s - cache.off  # the cache's own slot of position s
                    cache.k[li, :, at : at + (e - a)] = k[:, a:e]
                    cache.v[li, :, at : at + (e - a)] = v[:, a:e]
                    if kernel[b]:
                        attend.attend(q[a:e], cache.k[li], cache.v[li], att[a:e], s, self.scale, bits[b],
                                      _prefix_at(cache, li))
                        continue
                    att[a:e] = _torch_block_attention(q[a:e], cache, li, s, masks[b], self.scale)  # [n_b, H D]
            o = w["wo"](att)  # [N, hidden]
            if w["bo"] is not None:
                o = o + w["bo"]
            x, h = self._add_rms(x, o, w["post_norm"])
            down = w["wdown"](self._gated(w["wgu"](h)))  # [N, 2I] -> [N, I] -> [N, hidden]
        if down is not None:
            x = x + down
        for (_, cache), s, n, (_, e, _) in zip(blocks, starts, lens, spans):
            if e == L:  # a piece part-way through the layers keeps its cache's length
                cache.length = s + n
        # rows of each block that get logits: all (True), none (False) or the last ("last")
        spans = [(offsets[b + 1] - 1 if need[b] == "last" else offsets[b], offsets[b + 1]) if need[b] else None
                 for b in range(len(blocks))]
        rows = [torch.arange(a, e) for span in spans if span for a, e in [span]]
        if not rows:
            return [hidden_out.get(b) for b in range(len(blocks))]
        logits = self.lm_head(self._rms(x[torch.cat(rows).to(self.device)], self.final_norm)).float()  # [rows, vocab]
        out, at = [], 0
        for span in spans:
            if span:
                out.append(logits[at : at + span[1] - span[0]])
                at += span[1] - span[0]
            else:
                out.append(hidden_out.get(len(out)))
        return out

    @staticmethod
    @torch.inference_mode()
    def keep_path(cache: KVCache, start: int, rows: list[int]) -> None:
        """After a tree block written at slots start .. : move the KV of its accepted `rows`
        (ascending block rows, row 0 the pending token first) to slots start, start + 1, ...
        Each row's keys were rotated at its depth, which is its slot on the path: a plain copy."""
        start -= cache.off  # the cache's own slots (the path lies past any shared prefix)
        src = [start + r for r in rows]
        if src == list(range(start, start + len(rows))):
            return
        dst = list(range(start, start + len(rows)))
        cache.k[:, :, dst] = cache.k[:, :, src]  # the right side is gathered first: overlaps are safe
        cache.v[:, :, dst] = cache.v[:, :, src]

    def forward(self, input_ids: list[int], cache: KVCache, *, all_logits: bool = True) -> torch.Tensor | None:
        """Run `input_ids` after the cache's `length` positions; the cache grows by len(input_ids).

        Returns logits `# [n, vocab]` (float32) when `all_logits`, else None (prefill).
        """
        return self.forward_batch([(input_ids, cache)], [all_logits])[0]


def _prefix_at(cache: KVCache, li: int) -> tuple | None:
    """`attend.attend`'s `prefix` for layer li of a cache (None without a shared prefix)."""
    if cache.prefix is None:
        return None
    return cache.prefix.k[li], cache.prefix.v[li], cache.off


def _depths(parents: list[int], n: int) -> list[int]:
    """Each row's depth in a tree block (row 0, the pending token, at 0)."""
    if len(parents) != n or not parents or parents[0] != -1:
        raise ValueError(f"a tree block's parents must cover its {n} rows, row 0 first (-1)")
    depth = [0] * n
    for r in range(1, n):
        par = parents[r]
        if not 0 <= par < r:
            raise ValueError(f"row {r}'s parent {par} is not an earlier row")
        depth[r] = depth[par] + 1
    return depth


def _tree_mask(parents: list[int], start: int, device) -> torch.Tensor:
    """`# [n, start + n]` bool: each row sees the cache and itself and its ancestors in the block."""
    n = len(parents)
    mask = torch.zeros(n, start + n, dtype=torch.bool)
    mask[:, :start] = True
    for r, par in enumerate(parents):
        if par >= 0:
            mask[r, start:] = mask[par, start:]
        mask[r, start + r] = True
    return mask.to(device)
