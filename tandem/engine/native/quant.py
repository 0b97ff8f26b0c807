"""Block-quantized linear weights (GGUF's Q4_0, Q4_1, Q8_0) run as they are stored: quant.c.

`QuantRows` holds a weight's rows unpacked (one quantized value per input, a scale and an offset
per block of 32 inputs, every kind written as w = q * d + m); it is made from a GGUF tensor's raw
blocks (`from_gguf`) or by quantizing a float weight as llama.cpp's quantizers do (`quantize`, for
tests and tiny models), and can be concatenated (fused QKV, gate/up) and re-ordered by rows (the
Q/K permutation of GGUF Llama files). `QuantizedWeight` packs it into quant.c's panel layout once;
a call takes float32 activations `# [n, in]` and returns `# [n, out]`.

Two arithmetics (`ACTIVATIONS`), each row-invariant: "int8" quantizes each input row to 8 bits per
block of 32 and sums integer products (llama.cpp's arithmetic; precision "gguf"; AVX-512 VNNI or AVX2), and
"float32" widens the weights and multiplies float activations (precision "gguf-float"; AVX-512).
The int8 arithmetic has an AVX2 form too (no VNNI: 16-bit pair sums widened, the same exact
integers), so its bits are the same on every x86 host with AVX2 and FMA (tested by building the
AVX2 form here).
`reference_int8` is the int8 arithmetic in plain C, one output at a time (the tests' reference).

The compiled kernels need a C compiler (built at first use like gemv.c); where neither runs
`library()` is None and a GGUF target is dequantized to float32 as before (tandem.engine.model.loading).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.engine.native import build

SOURCE = Path(__file__).with_name("quant.c")
LANES = 16  # outputs per panel
BLOCK = 32  # inputs per scale
ACTIVATIONS = ("int8", "float32")  # what a quantized weight multiplies: see the module's doc
KINDS = ("Q4_0", "Q4_1", "Q8_0")  # GGUF tensor types kept quantized; others are dequantized
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _bind(lib: ctypes.CDLL) -> None:
    for name in ("tandem_quant_rows_q4", "tandem_quant_rows_q8"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        fn.restype = None
    for name in ("tandem_quant_rows_q4a", "tandem_quant_rows_q8a"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
        fn.restype = None
    lib.tandem_quant_rows_a_ref.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
    lib.tandem_quant_rows_a_ref.restype = None
    lib.tandem_quant_available.restype = ctypes.c_int
    lib.tandem_quant_a_available.restype = ctypes.c_int
    lib.tandem_quant_a_isa.restype = ctypes.c_char_p
    if not lib.tandem_quant_available() and not lib.tandem_quant_a_available():
        raise OSError("built without AVX-512 or AVX2: neither arithmetic has a kernel here")


_kernel = build.Kernel(SOURCE, "quantized GEMM kernel", _bind)


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built or neither runs here."""
    return _kernel.library()


def int8_activations_available() -> bool:
    """Whether the int8-activation kernel runs here (AVX-512 VNNI, or AVX2 with FMA; precision "gguf")."""
    lib = library()
    return lib is not None and bool(lib.tandem_quant_a_available())


def float_activations_available() -> bool:
    """Whether the float-activation kernel runs here (AVX-512; precision "gguf-float")."""
    lib = library()
    return lib is not None and bool(lib.tandem_quant_available())


def int8_isa(lib: ctypes.CDLL | None = None) -> str:
    """The instruction set the int8-activation kernel was built for: "AVX-512 VNNI", "AVX2" or "none"."""
    lib = lib or library()
    return lib.tandem_quant_a_isa().decode() if lib is not None else "none"


def reference_int8(rows: QuantRows, x: torch.Tensor) -> torch.Tensor:
    """The int8-activation arithmetic (quant.c's definition) computed one output at a time in plain C:
    x `# [n, in]` float32 -> `# [n, out]`, the bits the vector kernel must give (tests)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the quantized GEMM kernel is not available on this host")
    n, k = x.shape
    x = x.float().contiguous()
    q, d, m = rows.q.to(torch.int8).contiguous(), rows.d.contiguous(), rows.m.contiguous()
    y = torch.empty(n, rows.shape[0], dtype=torch.float32)
    lib.tandem_quant_rows_a_ref(x.data_ptr(), q.data_ptr(), d.data_ptr(), m.data_ptr(), y.data_ptr(), n,
                                rows.shape[0], k, int(rows.q4))
    return y


@dataclass
class QuantRows:
    """A quantized weight `# [rows, k]`, k a multiple of 32, as w[r, i] = q[r, i] * d[r, i // 32] + m[r, i // 32].

    kind: the GGUF type it came from or follows. q: uint8 0..15 for Q4_0/Q4_1, int8 -127..127 for
    Q8_0 `# [rows, k]`; d, m: float32 `# [rows, k // 32]` (Q4_0: m = -8 d; Q8_0: m = 0), values
    that float16 holds exactly, as the file does."""

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def __post_init__(self) -> None:
        rows, k = self.q.shape
        if self.kind not in KINDS:
            raise ValueError(f"quantized kinds are {KINDS}, got {self.kind!r}")
        want = torch.int8 if self.kind == "Q8_0" else torch.uint8
        if self.q.dtype != want or k % BLOCK or self.d.shape != (rows, k // BLOCK) or self.m.shape != self.d.shape:
            raise ValueError(f"{self.kind} rows need q {want} [rows, k % 32 == 0] and d, m [rows, k/32]; got q "
                             f"{self.q.dtype} {tuple(self.q.shape)}, d {tuple(self.d.shape)}, m {tuple(self.m.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def q4(self) -> bool:
        return self.kind != "Q8_0"

    def dequantize(self) -> torch.Tensor:
        """The float32 weight `# [rows, k]` (the reference the kernel is tested against)."""
        d = self.d.repeat_interleave(BLOCK, 1)
        m = self.m.repeat_interleave(BLOCK, 1)
        return torch.addcmul(m, self.q.float(), d)

    @staticmethod
    def from_gguf(kind: str, raw: np.ndarray, k: int) -> QuantRows:
        """A GGUF tensor's raw blocks `# [rows, k / 32 * block bytes]` uint8 (gguf.GGUFReader's
        `data` for these types) in GGUF's layout: per block a float16 scale d (and for Q4_1 an
        offset m), then the values; a Q4 block holds inputs 0..15 in its bytes' low nibbles and
        16..31 in their high nibbles."""
        if kind not in KINDS:
            raise ValueError(f"quantized kinds are {KINDS}, got {kind!r}")
        rows = raw.shape[0]
        blocks = k // BLOCK
        size = _BLOCK_BYTES[kind]
        if k % BLOCK or raw.dtype != np.uint8 or raw.shape[1:] != (blocks * size,):
            raise ValueError(f"{kind} raw data for {k} inputs is uint8 [rows, {blocks * size}], got {raw.dtype} {raw.shape}")
        b = np.ascontiguousarray(raw).reshape(rows, blocks, size)
        d = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, blocks]
        if kind == "Q8_0":
            q = b[:, :, 2:].copy().view(np.int8).reshape(rows, k)
            m = np.zeros_like(d)
        else:
            off = 2 if kind == "Q4_0" else 4
            qs = b[:, :, off:]  # [rows, blocks, 16]
            q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(rows, k)
            m = -8.0 * d if kind == "Q4_0" else b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return QuantRows(kind, torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(d), torch.from_numpy(m))

    @staticmethod
    def quantize(w: torch.Tensor, kind: str) -> QuantRows:
        """Quantize a float weight `# [rows, k]` the way llama.cpp's reference quantizers do (scales
        rounded to float16, as a GGUF file stores them): Q8_0 symmetric by the block's largest
        magnitude, Q4_0 by its signed extreme (d = extreme / -8), Q4_1 from the block's min to max."""
        rows, k = w.shape
        if k % BLOCK:
            raise ValueError(f"a quantized weight's input size is a multiple of {BLOCK}, got {k}")
        x = w.detach().float().reshape(rows, k // BLOCK, BLOCK)
        half = lambda t: t.to(torch.float16).float()  # noqa: E731 - the file's precision for d and m
        recip = lambda d: torch.where(d != 0, 1 / d, torch.zeros_like(d))[..., None]  # noqa: E731
        # as llama.cpp's reference quantizers: q from the float32 scale, the scale stored as float16
        if kind == "Q8_0":
            d = x.abs().amax(-1) / 127
            q = (x * recip(d)).round().clamp(-127, 127).to(torch.int8)
            d, m = half(d), torch.zeros_like(d)
        elif kind == "Q4_0":
            d = x.gather(-1, x.abs().argmax(-1, keepdim=True))[..., 0] / -8  # the signed extreme maps to q = 0
            q = (x * recip(d) + 8.5).trunc().clamp(0, 15).to(torch.uint8)
            d = half(d)
            m = -8 * d
        elif kind == "Q4_1":
            lo, hi = x.amin(-1), x.amax(-1)
            d = (hi - lo) / 15
            q = ((x - lo[..., None]) * recip(d) + 0.5).trunc().clamp(0, 15).to(torch.uint8)
            d, m = half(d), half(lo)
        else:
            raise ValueError(f"quantized kinds are {KINDS}, got {kind!r}")
        return QuantRows(kind, q.reshape(rows, k), d, m)

    @staticmethod
    def cat(parts: list[QuantRows]) -> QuantRows:
        """Rows of several weights of one kind and input size, stacked (fused projections)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack weights of kinds {sorted(kinds)} into one")
        return QuantRows(parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                         torch.cat([p.m for p in parts]))

    def take_rows(self, order: torch.Tensor) -> QuantRows:
        """Rows in the order given `# [rows]` (a permutation)."""
        return QuantRows(self.kind, self.q[order], self.d[order], self.m[order])


def _panels(t: torch.Tensor) -> torch.Tensor:
    """`# [rows, c]` -> `# [ceil(rows/16), c, 16]`: 16 rows side by side, zero rows padding the last."""
    rows, c = t.shape
    panels = -(-rows // LANES)
    padded = torch.zeros(panels * LANES, c, dtype=t.dtype)
    padded[:rows] = t
    return padded.view(panels, LANES, c).transpose(1, 2).contiguous()


def _pack_int8_activations(rows: QuantRows) -> torch.Tensor:
    """quant.c's layout for the int8-activation kernel (see there) `# [panels, k/32, bytes]` uint8:
    per panel of 16 outputs and block, the weights (Q4: `[4, 16, 4]` bytes, inputs 4h..4h+3 of the
    block in the low nibbles and 16+4h.. in the high ones; Q8: `[8, 16, 4]` bytes, q + 128), then d
    `[16]` and (Q4) m `[16]` as float16: the file's bytes, 20 (Q4) or 34 (Q8) per output and block."""
    out, k = rows.shape
    panels, blocks = -(-out // LANES), k // BLOCK
    if not (torch.equal(rows.d.half().float(), rows.d) and torch.equal(rows.m.half().float(), rows.m)):
        raise ValueError("the int8-activation layout keeps d and m as float16, as GGUF files do: these do not fit")
    q = torch.zeros(panels * LANES, k, dtype=torch.int16)
    q[:out] = rows.q.to(torch.int16)
    q = q.view(panels, LANES, blocks, BLOCK)
    if rows.q4:
        lo, hi = q[..., :16].reshape(panels, LANES, blocks, 4, 4), q[..., 16:].reshape(panels, LANES, blocks, 4, 4)
        packed = lo | (hi << 4)  # [panels, 16, blocks, 4, 4]
    else:
        packed = (q + 128).view(panels, LANES, blocks, 8, 4)
    weights = packed.permute(0, 2, 3, 1, 4).to(torch.uint8).reshape(panels, blocks, -1)  # [panels, blocks, 256 | 512]
    scales = [_panels(rows.d)] + ([_panels(rows.m)] if rows.q4 else [])  # each [panels, blocks, 16] float32
    halves = [t.half().contiguous().view(torch.uint8) for t in scales]  # each [panels, blocks, 32]
    return torch.cat([weights, *halves], dim=2).contiguous()


class QuantizedWeight:
    """A quantized weight packed once into quant.c's layout; a call takes float32 activations
    x `# [n, in]` -> `# [n, out]` float32, any n. `activations` (ACTIVATIONS): the arithmetic, int8
    (llama.cpp's) or float32. Row-invariant: a row gets the same bits alone or in a block of any size
    (tested)."""

    def __init__(self, rows: QuantRows, activations: str = "int8"):
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        runs = int8_activations_available() if activations == "int8" else float_activations_available()
        if not runs:
            need = "AVX-512 VNNI or AVX2" if activations == "int8" else "AVX-512"
            raise RuntimeError(f"the quantized GEMM kernel with {activations} activations is not available on this "
                               f"host (needs {need} and a C compiler)")
        self.kind, self.activations = rows.kind, activations
        self.out_features, self.in_features = rows.shape
        if activations == "int8":
            self.q = _pack_int8_activations(rows)  # weights and scales in one stream
            self.dm = None
        else:
            q = _panels(rows.q)  # [panels, k, 16]
            if rows.q4:  # two inputs per byte: input 2j in the low nibble, 2j + 1 in the high one
                q = q[:, 0::2] | (q[:, 1::2] << 4)  # [panels, k/2, 16]
            self.q = q.contiguous()
            self.dm = torch.stack([_panels(rows.d), _panels(rows.m)]).contiguous()  # [2, panels, k/32, 16]
        self.nbytes = self.q.numel() * self.q.element_size() + (self.dm.numel() * 4 if self.dm is not None else 0)
        lib = library()
        fns = {("int8", True): lib.tandem_quant_rows_q4a, ("int8", False): lib.tandem_quant_rows_q8a,
               ("float32", True): lib.tandem_quant_rows_q4, ("float32", False): lib.tandem_quant_rows_q8}
        self._fn = fns[activations, rows.q4]
        self._q_ptr = self.q.data_ptr()  # fixed for the weight's life
        self._dm_ptr = self.dm.data_ptr() if self.dm is not None else None

    def raw(self, x_ptr: int, y_ptr: int, n: int, threads: int) -> None:
        """The product straight on memory the caller owns and has checked: x `# [n, in]` and y
        `# [n, out]` float32 contiguous at these addresses (`__call__` checks, then does this)."""
        if self.dm is None:
            self._fn(x_ptr, self._q_ptr, y_ptr, n, self.out_features, self.in_features, threads)
        else:
            self._fn(x_ptr, self._q_ptr, self._dm_ptr, y_ptr, n, self.out_features, self.in_features, threads)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = x.shape
        if k != self.in_features or x.device.type != "cpu" or x.dtype != torch.float32:
            raise ValueError(f"a quantized weight takes float32 CPU activations [n, {self.in_features}], "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        y = torch.empty(n, self.out_features, dtype=torch.float32)
        self.raw(x.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
        return y


@dataclass
class QuantizedLinears:
    """The linear weights of a Llama-family GGUF kept quantized, in NativeLlama's fused layout:
    per layer "wqkv" (q, k, v rows stacked), "wo", "wgu" (gate, up) and "wdown", each a QuantRows
    or None where the file's type is not one of KINDS (or the parts of a fused weight differ in
    kind: that weight is dequantized to float32 as before); `head` likewise (the output matrix, or
    the token embedding where the file ties them)."""

    path: str
    layers: list[dict[str, QuantRows | None]]
    head: QuantRows | None
    activations: str = "int8"  # ACTIVATIONS: what QuantizedWeight multiplies them by

    @property
    def kinds(self) -> list[str]:
        """The quantized kinds in use, most weights first (e.g. ["Q4_1", "Q8_0"])."""
        count: dict[str, int] = {}
        for rows in [r for layer in self.layers for r in layer.values()] + [self.head]:
            if rows is not None:
                count[rows.kind] = count.get(rows.kind, 0) + rows.q.numel()
        return sorted(count, key=lambda k: -count[k])

    @property
    def describe(self) -> str:
        """One phrase for logs and /v1/models: 'GGUF Q4_1 + Q8_0, int8 activations', or 'float32' when
        nothing is kept."""
        return f"GGUF {' + '.join(self.kinds)}, {self.activations} activations" if self.kinds else "float32"


def _llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """GGUF Llama files store q and k rows interleaved per head for llama.cpp's RoPE (pairs (i, i + D/2)
    side by side); the order `# [rows]` that gives back the Hugging Face rows (what transformers'
    GGUF loader undoes for the float weights)."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(rows)


_GGML_KINDS = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}  # ggml type ids of KINDS
# bytes of one GGUF metadata value by type id (8 string, 9 array: read apart)
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file as `gguf_tensors` indexes it: its ggml type id (and the name of
    it where it is one of KINDS, else None), its shape in GGUF's order (the input size first) and,
    for KINDS, its raw blocks `# [rows, k / 32 * block bytes]` uint8, a view of the mapped file."""

    type_id: int
    kind: str | None
    shape: tuple[int, ...]
    raw: np.ndarray | None


def gguf_tensors(path: str | Path) -> tuple[dict[str, str | int], dict[str, GGUFTensor]]:
    """The scalar and string metadata and the tensors of a GGUF file (versions 2 and 3), read from
    the header and a memory map of the file: nothing is copied.

    Why not gguf.GGUFReader: it builds numpy views of every metadata field, the tokenizer's ~100k
    strings included: 3.3 of the 7.5 s `load_model` took for the embedded model (AMD EPYC, idle).
    Arrays are skipped here (strings by their lengths), and the tensors are what the reader gives
    (tested against it)."""
    import struct

    data = np.memmap(str(path), dtype=np.uint8, mode="r")
    buf = memoryview(data)
    at = 0

    def take(fmt: str):
        nonlocal at
        vals = struct.unpack_from("<" + fmt, buf, at)
        at += struct.calcsize("<" + fmt)
        return vals if len(vals) > 1 else vals[0]

    def text() -> str:
        nonlocal at
        n = take("Q")
        at += n
        return bytes(buf[at - n : at]).decode("utf-8", "replace")

    def value(kind: int):
        nonlocal at
        if kind == 8:
            return text()
        if kind == 9:
            elem, count = take("IQ")
            if elem == 8:
                for _ in range(count):
                    n = take("Q")  # (not `at += take(...)`: that reads `at` before take moves it)
                    at += n
            elif elem == 9:
                raise ValueError(f"{path}: nested metadata arrays are not supported")
            else:
                at += _GGUF_SCALAR[elem] * count
            return None
        fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[kind]
        return take(fmt)

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    at = 4
    version, n_tensors, n_kv = take("IQQ")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    meta: dict[str, str | int] = {}
    for _ in range(n_kv):
        key = text()
        kind = take("I")
        if kind not in _GGUF_SCALAR and kind not in (8, 9):
            raise ValueError(f"{path}: metadata {key!r} has an unknown type {kind}")
        v = value(kind)
        if v is not None:
            meta[key] = v
    infos = []
    for _ in range(n_tensors):
        name = text()
        dims = take("I")
        shape = tuple(int(d) for d in struct.unpack_from(f"<{dims}Q", buf, at))
        at += 8 * dims
        type_id, offset = take("IQ")
        infos.append((name, shape, type_id, offset))
    align = int(meta.get("general.alignment", 32))
    start = (at + align - 1) // align * align
    tensors = {}
    for name, shape, type_id, offset in infos:
        kind = _GGML_KINDS.get(type_id)
        raw = None
        if kind is not None:
            k, rows = shape[0], int(np.prod(shape[1:], dtype=np.int64))
            row_bytes = k // BLOCK * _BLOCK_BYTES[kind]
            first = start + offset
            raw = data[first : first + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(type_id, kind, shape, raw)
    return meta, tensors


def load_gguf_linears(path: str | Path, config, activations: str = "int8") -> QuantizedLinears:
    """Read the quantized linear weights of a Llama-family GGUF (the file transformers dequantizes
    for the same model: `config` is that model's config) without dequantizing them; `activations`
    (ACTIVATIONS) is the arithmetic they will run in."""
    meta, tensors = gguf_tensors(path)
    arch = meta.get("general.architecture", "llama")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads

    def rows(name: str, permute_heads: int | None = None) -> QuantRows | None:
        t = tensors.get(name)
        if t is None or t.kind is None:
            return None
        k = t.shape[0]  # GGUF's first dimension is the input size
        out = QuantRows.from_gguf(t.kind, t.raw, k)
        if permute_heads and arch == "llama":
            out = out.take_rows(_llama_row_order(out.shape[0], permute_heads))
        return out

    def fused(parts: list[QuantRows | None]) -> QuantRows | None:
        if any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
            return None
        return QuantRows.cat(parts)

    layers = []
    for i in range(config.num_hidden_layers):
        b = f"blk.{i}."
        layers.append({
            "wqkv": fused([rows(b + "attn_q.weight", heads), rows(b + "attn_k.weight", kv_heads), rows(b + "attn_v.weight")]),
            "wo": rows(b + "attn_output.weight"),
            "wgu": fused([rows(b + "ffn_gate.weight"), rows(b + "ffn_up.weight")]),
            "wdown": rows(b + "ffn_down.weight"),
        })
    head = rows("output.weight") if "output.weight" in tensors else rows("token_embd.weight")
    return QuantizedLinears(str(path), layers, head, activations)
