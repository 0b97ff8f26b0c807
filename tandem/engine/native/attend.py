"""Loads attend.c (causal attention of a block of query rows over a KV cache), compiling it at first use.

Every block on a CPU goes through it, a one-token step, a verification block or tree and a prompt
piece of any length alike, because a row's result depends only on its own query and the keys up to
its position, never on the rows beside it or the thread count: a position gets the same bits
however its prompt arrived (whole, in pieces, copied from another session's prefix) and whatever
ran beside it (docs/decisions.md, "One request, one answer").

Built like gemv.c (tandem.engine.native.build: the host's compiler, `-march=native`, cached per source,
flags and CPU), for AVX-512 or AVX2 with FMA and F16C (the same bits on both). On a CPU with
neither, without a compiler, or where the build fails, `library()` is None and the native forward
keeps torch's `scaled_dot_product_attention`, whose bits depend on the block's length: there a
prompt prefilled in other pieces can give other tokens (`NativeLlama.batch_invariant` is false).
`TANDEM_ATTENTION=torch` keeps torch's kernel everywhere (for comparison; gives that up too).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import torch

from tandem.engine.native import build

SOURCE = Path(__file__).with_name("attend.c")
MAX_ROWS = 32  # rows of a token-tree block (its masks are 32-bit); a longer causal block is split into blocks of this many
MAX_HEAD_DIM = 256
# what the cache may hold: float16 keys and values are widened exactly to float32 as they are read
# (half the bytes a step reads at long contexts; NativeLlama's `kv_dtype`)
KV_DTYPES = (torch.float32, torch.float16)


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.tandem_attend
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
                   + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
                   + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int])
    fn.restype = ctypes.c_int
    many = lib.tandem_attend_many
    many.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                     ctypes.c_int, ctypes.c_int]
    many.restype = ctypes.c_int


# One block's entry in `tandem_attend_many`'s descriptor array (int64 each): the addresses of q, k,
# v, out and the tree masks (0: causal), q's and out's row strides in floats, rows, start, the
# cache's capacity; then the shared prefix's keys and values (0: none), capacity and length.
DESC_FIELDS = ("q", "k", "v", "out", "tree", "q_stride", "o_stride", "n", "start", "cap",
               "pk", "pv", "pcap", "plen")
SPAN = 256  # keys per run of the kernel (attend.c): a shared prefix's length is a multiple of it


_kernel = build.Kernel(SOURCE, "CPU attention kernel", _bind,
                      enabled=lambda: os.environ.get("TANDEM_ATTENTION", "auto") != "torch")


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built (or is switched off) here."""
    return _kernel.library()


def serves(n: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a (causal) block of `n` query rows of this head size goes through the kernel: any
    length, the kernel splits it (`n` is kept for the callers that ask per block)."""
    return (device.type == "cpu" and dtype == torch.float32 and 0 < n and head_dim % 16 == 0
            and head_dim <= MAX_HEAD_DIM and library() is not None)


def tree_bits(parents: list[int]) -> ctypes.Array:
    """The rows' visibility masks of a token-tree block for `attend(tree=...)`: bit i of row r set
    when block row i is r itself or one of its ancestors. parents[r] is the block row r follows
    (-1 for row 0, the pending token); at most MAX_ROWS rows."""
    if len(parents) > MAX_ROWS:
        raise ValueError(f"a tree block has at most {MAX_ROWS} rows, got {len(parents)}")
    bits: list[int] = []
    for r, par in enumerate(parents):
        if not -1 <= par < r:
            raise ValueError(f"row {r}'s parent {par} is not an earlier row")
        bits.append((1 << r) | (bits[par] if par >= 0 else 0))
    return (ctypes.c_uint32 * len(bits))(*bits)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, start: int, scale: float,
           tree: ctypes.Array | None = None, prefix: "Prefix | None" = None) -> None:
    """Causal attention of a block's queries over one layer's cache, written into `out`; with
    `tree` (`tree_bits` of the block) each row sees the cache and its own ancestors in the block.

    q `# [n, H, D]` (rows may be strided; heads and dims contiguous): the queries at positions
    start .. start+n-1; k, v `# [KV, cap, D]` contiguous, positions 0 .. start+n-1 valid; out
    `# [n, H * D]` (rows may be strided). Query head h reads KV head h // (H // KV).
    Same result as `F.scaled_dot_product_attention(q.transpose(0, 1), k[:, :start+n], v[:, :start+n],
    causal mask offset by start, enable_gqa=True)`, within float32 rounding (tested).

    `prefix` (pk, pv, plen): positions 0 .. plen-1 live in pk, pv `# [KV, pcap, D]` (another
    cache's, shared) and k, v hold positions plen .. start+n-1 from their slot 0; plen is a
    multiple of SPAN and at most start. Same bits as the whole context in one cache (tested).
    """
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available on this host")
    _check(q, k, v, out, start, tree, prefix)
    n, H, D = q.shape
    KV, cap = k.shape[0], k.shape[1]
    pk, pv, pcap, plen = _prefix_fields(prefix)
    rc = lib.tandem_attend(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), out.data_ptr(), out.stride(0),
                           H, KV, n, D, start, cap, scale, torch.get_num_threads(),
                           None if tree is None else ctypes.addressof(tree), k.dtype == torch.float16,
                           pk, pv, pcap, plen)
    if rc != 0:
        raise MemoryError(f"the CPU attention kernel failed ({rc})")


Prefix = tuple  # (pk, pv, plen): a shared prefix's keys and values `# [KV, pcap, D]` and its length


def _prefix_fields(prefix: Prefix | None) -> tuple[int, int, int, int]:
    """(pk, pv, pcap, plen) as the kernel takes them; zeros for none."""
    if prefix is None:
        return 0, 0, 0, 0
    pk, pv, plen = prefix
    return pk.data_ptr(), pv.data_ptr(), pk.shape[1], plen


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, start: int,
           tree: ctypes.Array | None, prefix: Prefix | None = None) -> None:
    """What the kernel needs of one block (it reads raw pointers: anything else would read the
    wrong memory); raises ValueError naming what is wrong."""
    n, H, D = q.shape
    KV, cap = k.shape[0], k.shape[1]
    plen = 0
    if prefix is not None:
        pk, pv, plen = prefix
        if not (pk.is_contiguous() and pv.is_contiguous() and pk.shape == pv.shape and pk.dtype == pv.dtype == k.dtype
                and pk.shape[0] == KV and pk.shape[2] == D and pk.device.type == pv.device.type == "cpu"
                and 0 < plen <= pk.shape[1] and plen % SPAN == 0 and plen <= start):
            raise ValueError(f"a shared prefix needs contiguous pk/pv [KV, pcap, D] like k's ({k.dtype}) and a "
                             f"length that is a multiple of {SPAN}, at most pcap and start; got "
                             f"{tuple(pk.shape)} {pk.dtype}, length {plen}, start {start}")
    ok = (q.dtype == out.dtype == torch.float32 and k.dtype == v.dtype in KV_DTYPES and q.stride()[1:] == (D, 1)
          and k.is_contiguous() and v.is_contiguous() and k.shape == v.shape and k.shape[2] == D
          and out.stride(1) == 1 and tuple(out.shape) == (n, H * D) and H % KV == 0 and 0 < n
          and (tree is None or n <= MAX_ROWS)
          and D % 16 == 0 and D <= MAX_HEAD_DIM and 0 <= start and start + n - plen <= cap
          and all(t.device.type == "cpu" for t in (q, k, v, out)))
    if tree is not None and len(tree) != n:
        raise ValueError(f"tree has {len(tree)} rows' masks for a block of {n} rows")
    if not ok:
        raise ValueError(f"attend takes float32 CPU q [n, H, D (a multiple of 16)] (n <= {MAX_ROWS} for a tree), "
                         f"k/v contiguous "
                         f"[KV, cap, D] in float32 or float16 with start + n <= cap, out [n, H*D] float32; got q "
                         f"{tuple(q.shape)} {q.stride()} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} "
                         f"{v.dtype}, out {tuple(out.shape)}, start {start}")


def describe(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, start: int,
             tree: ctypes.Array | None, prefix: Prefix | None = None) -> list[int]:
    """One block's row of `tandem_attend_many`'s descriptor array (DESC_FIELDS), for tensors that
    passed `_check`."""
    return [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if tree is None else ctypes.addressof(tree),
            q.stride(0), out.stride(0), q.shape[0], start, k.shape[1], *_prefix_fields(prefix)]


def attend_many(blocks: list[tuple], scale: float) -> None:
    """`attend` for several blocks (q, k, v, out, start, tree[, prefix]) of the same head layout in one call of
    the kernel (one parallel region for all): each block's output has the bits `attend` gives it
    alone (tested), and this checked form is what the tests hold the kernel to. The batched forward
    (tandem.engine.model.llama) checks its blocks once at layer 0, builds these descriptor rows with
    `describe` and calls `tandem_attend_many` itself for the other layers (no Python per block)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available on this host")
    if not blocks:
        return
    H, D, KV = blocks[0][0].shape[1], blocks[0][0].shape[2], blocks[0][1].shape[0]
    kv_dtype = blocks[0][1].dtype
    rows = []
    for q, k, v, out, start, tree, *prefix in blocks:
        prefix = prefix[0] if prefix else None
        _check(q, k, v, out, start, tree, prefix)
        if (q.shape[1], q.shape[2], k.shape[0], k.dtype) != (H, D, KV, kv_dtype):
            raise ValueError(f"every block needs the first's heads ({H}, {KV} KV), head size {D} and cache type "
                             f"{kv_dtype}; got {q.shape[1]}, {k.shape[0]} KV, {q.shape[2]}, {k.dtype}")
        rows.append(describe(q, k, v, out, start, tree, prefix))
    desc = np.array(rows, dtype=np.int64)  # [blocks, len(DESC_FIELDS)]
    rc = lib.tandem_attend_many(len(rows), desc.ctypes.data, H, KV, D, scale, torch.get_num_threads(),
                                kv_dtype == torch.float16)
    if rc != 0:
        raise MemoryError(f"the CPU attention kernel failed ({rc})")
