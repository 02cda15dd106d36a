"""Row-invariant CPU kernels: products, elementwise functions, attention over the pools
and the recurrences, each computing an output element by one fixed sequence of IEEE
operations whatever the rows beside it (kernels.c says how). They are what makes a
token's values the same bits in a decode step, a prefill chunk of any size and the
no-cache forward, in every precision, on any CPU.

The C source is compiled on first use for the CPU at hand (-march=native) with the
system's C compiler and cached (build.py); it is called through ctypes (the call
releases the GIL; its OpenMP threads are torch's own). Where no compiler is found, or
`UNIRADIX_KERNELS=torch` asks for it, `available()` is False and the model's ops take
torch's kernels, whose rows depend on the rows computed beside them (docs/models.md,
*Row-invariant kernels*)."""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from . import build

log = logging.getLogger("uniradix.kernels")

#: panel width of a packed weight (kernels.c's NR)
NR = 16
#: weight rows a quantized weight's panel holds, a vector lane each (kernels.c's QP)
PW = 16
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_PAIRED = 3   # kernels.c's DT_BF16P: bfloat16 panels in pairs
#: elementwise operations (kernels.c's EW_*)
OPS = {"exp": 0, "sigmoid": 1, "silu": 2, "softplus": 3, "gelu_tanh": 4, "tanh": 5}

_lib = None
_state = {"tried": False, "why": "", "off": 0}

_i64, _f32, _int, _p = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "ur_linear_io": [_p, _int, _i64, _i64, _i64, _p, _int, _i64, _p, _p, _int, _i64, _int],
    "ur_elementwise_io": [_int, _p, _int, _p, _int, _i64, _f32, _int],
    "ur_act_mul": [_int, _p, _i64, _p, _i64, _int, _p, _i64, _i64, _f32, _int],
    "ur_attention": [_p, _int, _i64, _i64, _i64, _p, _p, _int, _i64, _p, _p, _p, _f32, _p, _p, _int],
    "ur_delta_rule": [_p, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _int],
    "ur_ssm_scan": [_p, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _int],
    "ur_linear_q": [_p, _int, _i64, _i64, _i64, _p, _p, _p, _int, _i64, _i64, _p, _p, _i64, _int],
    "ur_rows_q": [_p, _p, _p, _int, _i64, _i64, _p, _i64, _p],
    "ur_rms_norm_io": [_p, _int, _p, _int, _i64, _i64, _p, _f32, _p, _int],
    "ur_rope": [_p, _p, _int, _i64, _i64, _i64, _i64, _p, _p],
    "ur_greedy_build": [_p, _int, _i64, _i64, _p, _p, _p, _p, _p, _int],
    "ur_greedy_candidates": [_p, _i64, _i64, _p, _p, _p, _p, _p, _i64, ctypes.c_double, ctypes.c_double,
                             ctypes.c_double, _p, _p, _i64, _p],
}


def _load():
    _state["tried"] = True
    if os.environ.get("UNIRADIX_KERNELS", "").lower() == "torch":
        _state["why"] = "UNIRADIX_KERNELS=torch"
        return None
    try:
        return _bind(build.library())
    except (build.BuildError, OSError) as e:
        _state["why"] = str(e)
        log.warning("row-invariant kernels unavailable (%s): torch's kernels instead, whose rows depend on the rows "
                    "computed beside them", e)
        return None


def _bind(path: str):
    lib = ctypes.CDLL(path)
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.ur_isa.restype = ctypes.c_char_p
    lib.ur_argmax.argtypes, lib.ur_argmax.restype = [_p, _i64], _i64
    lib.ur_amx.argtypes, lib.ur_amx.restype = [_int], _int
    lib.ur_amx_bf16.argtypes, lib.ur_amx_bf16.restype = [_i64], _int
    lib.ur_version.restype = _int
    return lib


def lib():
    """The loaded library, or None (compiled on the first call)."""
    global _lib
    if not _state["tried"]:
        _lib = _load()
    return _lib


def available() -> bool:
    return not _state["off"] and lib() is not None


class off:
    """`with kernels.off():` torch's kernels for what runs inside (an A/B baseline in one
    process: benchmarks/engine_ab.py). Process-wide while it lasts."""

    def __enter__(self):
        _state["off"] += 1
        return self

    def __exit__(self, *exc):
        _state["off"] -= 1


class isa:
    """`with kernels.isa("x86-64-v3"):` the kernels built for another CPU level (-march)
    for what runs inside: on an AVX-512 machine its AVX2 paths (x86-64-v3) or the scalar
    ones (x86-64), which must give the same bits (tests/model/hf/test_instruction_sets.py), or an A/B
    run of one against the other in one process. Process-wide while it lasts; raises
    build.BuildError where that level cannot be built."""

    def __init__(self, march: str) -> None:
        self.march = march
        self.lib = _bind(build.library(march))

    def __enter__(self):
        global _lib
        lib()
        self.saved = _lib
        _lib = self.lib
        return self

    def __exit__(self, *exc):
        global _lib
        _lib = self.saved


def amx_bfloat16() -> bool:
    """Whether bfloat16 x bfloat16 products run on AMX's bfloat16 tiles here (kernels.c,
    linear_bf16_amx): their own arithmetic, not the vector path's chain."""
    return available() and bool(lib().ur_amx_bf16(32))


def identity(dtype: torch.dtype | None = None) -> str:
    """Which arithmetic a forward in `dtype` runs (for the L3 witness: KV computed by
    another must not be reused as if it were this one's): the row-invariant kernels'
    version (the same bits on every CPU), and for bfloat16 whether its products take
    AMX's tiles (the same bits on every CPU that has them, other bits than elsewhere);
    or torch's kernels."""
    if not available():
        return "torch"
    amx = ", bfloat16 on AMX tiles" if dtype is torch.bfloat16 and amx_bfloat16() else ""
    return f"row-invariant v{lib().ur_version()}{amx}"


class no_amx:
    """`with kernels.no_amx():` products without AMX's tiles: quantized ones of many rows
    (the same bits) and bfloat16 x bfloat16 ones (the vector path's chain: other bits;
    see `identity`), for tests and A/B runs. Process-wide while it lasts."""

    def __enter__(self):
        self.was = bool(available() and lib().ur_amx(-1))
        if available():
            lib().ur_amx(0)
        return self

    def __exit__(self, *exc):
        if self.was:
            lib().ur_amx(1)


def describe() -> str:
    """For the start-up line: which kernels the forward runs on."""
    if available():
        amx = (", AMX tiles for bfloat16 products and quantized ones of 16 rows or more" if amx_bfloat16()
               else ", AMX tiles for quantized products of 16 rows or more" if _lib.ur_amx(-1) else "")
        return f"row-invariant kernels ({_lib.ur_isa().decode()}{amx})"
    if _state["off"]:
        return "torch's kernels (switched off here)"
    return (f"torch's kernels ({_state['why'] or 'not loaded'}): a row's values depend on the rows beside it, so "
            "reuse is exact only within a bound")


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


def _on_cpu(*ts) -> bool:
    return all(t is None or t.device.type == "cpu" for t in ts)


# ---------------------------------------------------------------------------- products
class _Packed:
    """What a packed weight answers as the [out, in] matrix it stands for (its storage:
    the tensor named by `_storage`; `dense()` gives the matrix back): shape, device,
    dimensions, and a move, which leaves the CPU's kernels for the dense matrix."""

    __slots__ = ()

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return getattr(self, self._storage).device

    def dim(self) -> int:
        return 2

    def to(self, device):
        """Itself on the CPU; elsewhere the dense weight (the kernels are the CPU's)."""
        return self if torch.device(device).type == "cpu" else self.dense().to(device)


class PackedWeight(_Packed):
    """W [out, in] in panels of NR output columns, [panel][in][NR], in its own dtype
    (float32, bfloat16 or float16); what `linear` multiplies. A bfloat16 weight with an
    even number of inputs lies in pairs, [panel][in / 2][NR][2] (`paired`: how AMX's
    bfloat16 tiles and VDPBF16PS read it, and the vector path too, each pair's odd
    input first). Holds the same values as the dense
    weight (`dense()` gives it back, for the witness and for moving it)."""

    __slots__ = ("panels", "out_features", "in_features")
    _storage = "panels"

    def __init__(self, w: torch.Tensor) -> None:
        if w.dim() != 2 or w.dtype not in _DTYPES:
            raise ValueError(f"cannot pack a {tuple(w.shape)} {w.dtype} weight")
        N, K = w.shape
        P = -(-N // NR)
        padded = w.new_zeros(P * NR, K)
        padded[:N] = w
        self.out_features, self.in_features = N, K
        if w.dtype is torch.bfloat16 and K % 2 == 0:
            self.panels = padded.view(P, NR, K // 2, 2).permute(0, 2, 1, 3).reshape(P, K, NR).contiguous()
        else:
            self.panels = padded.view(P, NR, K).transpose(1, 2).contiguous()

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def paired(self) -> bool:
        return self.panels.dtype is torch.bfloat16 and self.in_features % 2 == 0

    @property
    def code(self) -> int:
        """The panels' dtype as kernels.c names it (DT_BF16P for pairs)."""
        return _PAIRED if self.paired else _DTYPES[self.panels.dtype]

    def dense(self) -> torch.Tensor:
        P, K = self.panels.shape[0], self.in_features
        if self.paired:
            return self.panels.view(P, K // 2, NR, 2).permute(0, 2, 1, 3).reshape(P * NR, K)[:self.out_features].contiguous()
        return self.panels.transpose(1, 2).reshape(P * NR, K)[:self.out_features].contiguous()

    def tensors(self) -> torch.Tensor:
        """What the weights' witness and fingerprint read: the dense weight."""
        return self.dense()

    def take_panels(self, panels: torch.Tensor) -> "PackedWeight":
        """The weight of these panels only (ascending indices), outputs 16 a panel: each
        output the same bits as in the whole product (a lane's chain is its own)."""
        sub = PackedWeight.__new__(PackedWeight)
        sub.panels, sub.in_features, sub.out_features = self.panels.index_select(0, panels), self.in_features, \
            panels.numel() * NR
        return sub

    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()

    def __repr__(self) -> str:
        return f"PackedWeight({self.out_features}x{self.in_features}, {self.dtype})"


def _rows(call, ids: torch.Tensor, K: int) -> torch.Tensor:
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), K, dtype=torch.float32)
    call(flat.data_ptr(), flat.numel(), out.data_ptr())
    return out.view(*ids.shape, K)


class PackedQuant(_Packed):
    """W [out, in] as a GGUF file stores it (model/hf/gguf_blocks.Codes: codes u, per-group
    scales a and offsets b, w = a (u - off) + b), in panels of PW rows and blocks of 32
    inputs (`_panel_blocks`) at about the file's bits per weight (kernels.c, ur_linear_q),
    with float32 a and c = b - a off per group: `linear_q` multiplies it the way llama.cpp
    does (activations rounded to 8 bits per block of 32, integer dot products), and a
    lookup (`rows`) gives the file's own dequantised float32 values. `dtype` is float32
    (what it stands for)."""

    __slots__ = ("codes", "a", "c", "out_features", "in_features", "bits", "group", "kind")
    _storage = "codes"

    dtype = torch.float32

    def __init__(self, codes, kind: str = "") -> None:
        u = torch.as_tensor(codes.u)
        a = torch.as_tensor(codes.a, dtype=torch.float32)
        b = None if codes.b is None else torch.as_tensor(codes.b, dtype=torch.float32)
        N, K = u.shape
        G, bits = codes.group, codes.bits
        if K % 32 or K % G or 32 % G or bits not in (4, 5, 6, 8):
            raise ValueError(f"cannot pack {N}x{K} codes of {bits} bits in groups of {G}")
        self.out_features, self.in_features = N, K
        if codes.off:  # a * off is exact (a small power of two times a float16 product)
            off = a * float(codes.off)
            b = -off if b is None else b - off
        self.bits, self.group, self.kind = bits, G, kind
        pad = -N % PW  # rows of zeros (a = 0) to fill the last panel
        if pad:
            u = torch.cat([u, u.new_zeros(pad, K)])
            a = torch.cat([a, a.new_zeros(pad, K // G)])
            b = None if b is None else torch.cat([b, b.new_zeros(pad, K // G)])

        def panels(t):  # [rows, per] -> [panels, per, PW]: the panel's rows side by side
            return t.view(-1, PW, t.shape[1], *t.shape[2:]).transpose(1, 2).contiguous()
        self.a, self.c = panels(a), None if b is None else panels(b)
        self.codes = _panel_blocks(u, bits)   # [panels, blocks, panel block bytes]

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids]: an embedding lookup reading the blocks (float32)."""
        return self.rows(torch.as_tensor(ids))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as float32 [n, in] (each the file's dequantised values)."""
        return _rows(lambda i, n, out: lib().ur_rows_q(self.codes.data_ptr(), self.a.data_ptr(), _ptr(self.c),
                                                       self.bits, self.group, self.in_features, i, n, out),
                     ids, self.in_features)

    def dense(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def tensors(self) -> dict:
        """What the weights' witness and fingerprint read: the packed form itself (its
        codes and scales are what the forward computes with)."""
        out = {"codes": self.codes, "a": self.a, "layout": torch.tensor([self.bits, self.group], dtype=torch.int64)}
        if self.c is not None:
            out["c"] = self.c
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.a, self.c) if t is not None)

    def __repr__(self) -> str:
        return f"PackedQuant({self.out_features}x{self.in_features}, {self.kind or f'{self.bits}-bit'})"


def _panel_blocks(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes u [rows (a multiple of PW), K] in kernels.c's panel blocks: per panel of PW
    rows and block of 32 inputs, eight lines of 64 bytes, line g [row j][input 4g + i]
    (an AMX B tile's rows, a vector lane a row); 4 and 5 bits: lines g and g + 4 in one
    line's low and high nibbles; 5 bits: then per line a 64-bit word, bit 4j + i that
    code's fifth bit."""
    rows, K = u.shape
    lines = u.view(rows // PW, PW, K // 32, 8, 4).permute(0, 2, 3, 1, 4)   # [panel, block, line, row, 4]
    if bits in (6, 8):
        return lines.contiguous().view(torch.uint8).reshape(rows // PW, K // 32, 8 * 64)
    c = lines.to(torch.int32)
    nib = ((c[:, :, :4] & 0x0F) | ((c[:, :, 4:] & 0x0F) << 4)).to(torch.uint8).reshape(rows // PW, K // 32, 4 * 64)
    if bits == 4:
        return nib.contiguous()
    fifth = ((c >> 4) & 1).reshape(rows // PW, K // 32, 8, 8, 8)            # [.., line, byte, bit]
    words = (fifth << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8).reshape(rows // PW, K // 32, 64)
    return torch.cat([nib, words], dim=-1).contiguous()


def linear_q(x: torch.Tensor, w: PackedQuant, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T (+ b) over a PackedQuant, rounded once to x's dtype: each row's
    activations rounded to 8 bits per block of 32 and multiplied in integers by the
    codes, the scales applied in float32 (ur_linear_q): a row's values whatever rows come
    with it, within that rounding of the float32 product."""
    K, N = w.in_features, w.out_features
    if x.shape[-1] != K:
        raise ValueError(f"linear: input has {x.shape[-1]} features, the weight takes {K}")
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, K)
    xdt = _DTYPES.get(x2.dtype)
    if xdt is None or x2.stride(-1) != 1:   # rows may lie apart; 16-bit ones are converted in the call
        x2, xdt = x2.float().contiguous(), 0
    if b is not None and (b.dtype is not torch.float32 or not b.is_contiguous()):
        b = b.float().contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=torch.float32)
    lib().ur_linear_q(x2.data_ptr(), xdt, M, K, x2.stride(0) if M > 1 else K, w.codes.data_ptr(), w.a.data_ptr(),
                      _ptr(w.c), w.bits, w.group, N, None if b is None else b.data_ptr(), y.data_ptr(), N,
                      torch.get_num_threads())
    if x.dtype is not torch.float32:
        y = y.to(x.dtype)
    return y if flat else y.view(*x.shape[:-1], N)


def fuse(ws: list):
    """One packed weight whose outputs are those of `ws` side by side (q, k and v; gate
    and up): one product where there were several, a row's values the same bits (each
    output is its own chain, whatever is computed beside it). The parts become views of
    its storage, so nothing is held twice and each part still multiplies alone. None
    where they cannot be one: not all PackedWeights of one dtype or PackedQuants of one
    format, or a part but the last that does not fill its last panel."""
    if len(ws) < 2:
        return None
    first = ws[0]
    if all(type(w) is PackedWeight and w.dtype == first.dtype and w.in_features == first.in_features for w in ws):
        if any(w.out_features % NR for w in ws[:-1]):
            return None
        fused = PackedWeight.__new__(PackedWeight)
        fused.panels = torch.cat([w.panels for w in ws])
        fused.in_features, fused.out_features = first.in_features, sum(w.out_features for w in ws)
        p0 = 0
        for w in ws:
            n = w.panels.shape[0]
            w.panels = fused.panels[p0:p0 + n]
            p0 += n
        return fused
    same = ("bits", "group", "in_features")
    if all(type(w) is PackedQuant and all(getattr(w, k) == getattr(first, k) for k in same)
           and (w.c is None) == (first.c is None) for w in ws):
        if any(w.out_features % PW for w in ws[:-1]):
            return None
        fused = PackedQuant.__new__(PackedQuant)
        fused.bits, fused.group, fused.in_features = first.bits, first.group, first.in_features
        fused.out_features = sum(w.out_features for w in ws)
        fused.kind = "+".join(dict.fromkeys(w.kind for w in ws))
        fused.codes, fused.a = torch.cat([w.codes for w in ws]), torch.cat([w.a for w in ws])
        fused.c = None if first.c is None else torch.cat([w.c for w in ws])
        p0 = 0
        for w in ws:
            n = w.codes.shape[0]
            w.codes, w.a = fused.codes[p0:p0 + n], fused.a[p0:p0 + n]
            if w.c is not None:
                w.c = fused.c[p0:p0 + n]
            p0 += n
        return fused
    return None


class PackedExperts:
    """An expert stack [experts, out, in], each expert a PackedWeight: `[e]` is expert e."""

    __slots__ = ("experts",)

    def __init__(self, stack: torch.Tensor) -> None:
        self.experts = [PackedWeight(w) for w in stack]

    def __getitem__(self, e: int) -> PackedWeight:
        return self.experts[e]

    def __len__(self) -> int:
        return len(self.experts)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.experts), *self.experts[0].shape))

    @property
    def dtype(self) -> torch.dtype:
        return self.experts[0].dtype

    def dim(self) -> int:
        return 3

    @property
    def device(self) -> torch.device:
        return self.experts[0].device

    def dense(self) -> torch.Tensor:
        return torch.stack([w.dense() for w in self.experts])

    def tensors(self) -> torch.Tensor:
        return self.dense()

    def nbytes(self) -> int:
        return sum(w.nbytes() for w in self.experts)

    def to(self, device):
        return self if torch.device(device).type == "cpu" else self.dense().to(device)


def linear(x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None = None,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., in] @ W^T (+ b) accumulated in float32 (each output one chain of fused
    multiply-adds in input order, paired bfloat16 weights each pair's odd input first,
    by VDPBF16PS for bfloat16 rows where the CPU has AVX512-BF16; bfloat16 x bfloat16 on
    AMX's tiles where the CPU has them), rounded once to x's dtype (or `dtype`: float32 keeps the sums). (Called ~100 times a decode
    step: every torch call here costs microseconds, so none is made that is not needed.)"""
    K, N = w.in_features, w.out_features
    if x.shape[-1] != K:
        raise ValueError(f"linear: input has {x.shape[-1]} features, the weight takes {K}")
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, K)
    xdt = _DTYPES.get(x2.dtype)
    if xdt is None or x2.stride(-1) != 1 or x2.device.type != "cpu":  # rows may lie apart (a fused product's part)
        x2, xdt = x2.float().contiguous(), 0
    if b is not None and (b.dtype is not torch.float32 or not b.is_contiguous()):
        b = b.float().contiguous()
    want = x.dtype if dtype is None else dtype
    out = torch.bfloat16 if want is torch.bfloat16 else torch.float32  # rounded in the call; float16 below
    y = torch.empty((x2.shape[0], N), dtype=out)
    lib().ur_linear_io(x2.data_ptr(), xdt, x2.shape[0], K, x2.stride(0) if x2.shape[0] > 1 else K,
                       w.panels.data_ptr(), w.code, N, None if b is None else b.data_ptr(),
                       y.data_ptr(), _DTYPES[out], N, torch.get_num_threads())
    if want is not out:
        y = y.to(want)
    return y if flat else y.view(*x.shape[:-1], N)


# ---------------------------------------------------------------------------- elementwise
def elementwise(op: str, x: torch.Tensor, param: float = 0.0) -> torch.Tensor:
    """f(x) computed in float32 by kernels.c's fixed implementation, rounded to x's
    dtype."""
    dtype, xdt = x.dtype, _DTYPES.get(x.dtype)
    if xdt is None or not x.is_contiguous():
        x, xdt = x.float().contiguous(), 0
    out = torch.bfloat16 if dtype is torch.bfloat16 else torch.float32   # rounded in the call; float16 below
    y = torch.empty(x.shape, dtype=out)
    lib().ur_elementwise_io(OPS[op], x.data_ptr(), xdt, y.data_ptr(), _DTYPES[out], x.numel(), float(param),
                            torch.get_num_threads())
    return y if dtype is out else y.to(dtype)


def act_mul(op: str, g: torch.Tensor, u: torch.Tensor, param: float = 0.0) -> torch.Tensor | None:
    """elementwise(op, g) * u in one call, the same bits (g's activation rounded to the
    dtype, then the product rounded): g and u of one shape [..., n] and one dtype (float32
    or bfloat16), each element of a row adjacent (rows may lie apart: the two halves of a
    fused gate-and-up product). None where they are not so (the caller composes the two)."""
    n = g.shape[-1] if g.dim() else 0
    if (g.dtype not in (torch.float32, torch.bfloat16) or u.dtype is not g.dtype or u.shape != g.shape or g.dim() < 1
            or n == 0 or g.device.type != "cpu" or u.device.type != "cpu"):
        return None
    g2, u2 = g.reshape(-1, n) if g.is_contiguous() else g, u.reshape(-1, n) if u.is_contiguous() else u
    if g2.dim() != 2 or u2.dim() != 2 or g2.stride(1) != 1 or u2.stride(1) != 1:
        return None
    y = torch.empty(g.shape, dtype=g.dtype)
    lib().ur_act_mul(OPS[op], g2.data_ptr(), g2.stride(0), u2.data_ptr(), u2.stride(0), _DTYPES[g.dtype], y.data_ptr(),
                     g2.shape[0], n, float(param), torch.get_num_threads())
    return y


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, dtype: torch.dtype = torch.float32,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last dimension, in float32 (w float32 or
    None), each row's sum in one fixed order (kernels.c, ur_rms_norm), rounded to `dtype`
    (bfloat16 inside the call, as torch's .to() rounds): one call where torch's
    composite takes several. With `residual` (x's shape, in `dtype`: float32 or
    bfloat16), residual + that, as torch's add rounds it: the sandwich norms' residual
    add in the same call."""
    n = x.shape[-1]
    xdt = _DTYPES.get(x.dtype)
    if xdt is None or not x.is_contiguous():
        x, xdt = x.float().contiguous(), 0
    if w is not None and (w.dtype is not torch.float32 or not w.is_contiguous() or w.numel() != n):
        raise ValueError(f"rms_norm: the scale must be {n} contiguous float32 values")
    out = torch.bfloat16 if dtype is torch.bfloat16 else torch.float32
    if residual is not None and (residual.dtype is not dtype or dtype is not out or residual.shape != x.shape
                                 or not residual.is_contiguous()):
        raise ValueError(f"rms_norm: a residual must be contiguous float32 or bfloat16 of the input's shape, in "
                         f"the output dtype ({dtype})")
    y = torch.empty(x.shape, dtype=out)
    lib().ur_rms_norm_io(x.data_ptr(), xdt, y.data_ptr(), _DTYPES[out], x.numel() // n if n else 0, n, _ptr(w),
                         float(eps), _ptr(residual), torch.get_num_threads())
    return y if dtype is out else y.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE over x [N, heads, d] (float32 or bfloat16): x * cos + roll(x, rot / 2) *
    signed_sin on the first rot dims of each head, the rest passed through, with cos and
    the half-negated sin [N, rot] (or [N, 1, rot]) in x's dtype; each product and the sum
    rounded as torch's ops round them, in one call where torch takes seven."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 3:
        raise ValueError("rope: x must be [N, heads, d] in float32 or bfloat16")
    N, H, d = x.shape
    rot = cos.shape[-1]
    cos, signed_sin = cos.reshape(-1, rot), signed_sin.reshape(-1, rot)
    if (rot % 2 or rot > d or cos.shape[0] != N or signed_sin.shape != cos.shape or cos.dtype != x.dtype
            or signed_sin.dtype != x.dtype):
        raise ValueError(f"rope: cos and sin must be [{N}, rot <= {d}] (rot even) in {x.dtype}")
    x, cos, signed_sin = x.contiguous(), cos.contiguous(), signed_sin.contiguous()
    y = torch.empty_like(x)
    lib().ur_rope(x.data_ptr(), y.data_ptr(), _DTYPES[x.dtype], N, H, d, rot, cos.data_ptr(), signed_sin.data_ptr())
    return y


def argmax(x: torch.Tensor) -> int:
    """torch.argmax of a 1-D float32 CPU tensor (the first of equal values, the first NaN),
    in one C pass: greedy sampling over a 262k-word row in a tenth of torch's time."""
    if x.dim() != 1 or x.dtype is not torch.float32 or x.device.type != "cpu":
        raise ValueError("argmax: a 1-D float32 tensor on the CPU")
    x = x.contiguous()
    return int(lib().ur_argmax(x.data_ptr(), x.numel())) if x.numel() else int(torch.argmax(x))


# ---------------------------------------------------------------------------- greedy head
class GreedyHead:
    """The argmax of `finish(linear(x, head))` for rows x, the same index as over the full
    logits, reading half a bfloat16 head's bytes (a quarter of a float32 one's):
    an int8 copy of the head (a scale a word) and each row rounded to int8 in two parts bound
    every logit (kernels.c, ur_greedy_candidates: the roundings' errors by their norms,
    the head's own float chain by its worst case), and the words whose upper bound reaches
    the best lower bound are computed exactly, by the head's own product on their panels
    (the pass keeps only the words that reach the best lower bound seen so far: no bound
    is stored for every word).
    `finish` (the family's scaling of the logits) must be non-decreasing in each logit;
    16-bit logits may tie after their rounding, so the bar is lowered by four of their
    units, and the first of equal values wins, as torch.argmax. A row whose bound leaves
    more than `cap` candidates, or that is not finite, goes through the full head."""

    def __init__(self, head: "PackedWeight", cap: int = 4096) -> None:
        w = head.dense()
        V, K = w.shape
        self.head, self.V, self.K, self.cap = head, V, K, cap
        P, Kp = -(-V // NR), -(-K // 4) * 4
        self.codes = torch.zeros(P, Kp // 4, NR, 4, dtype=torch.int8)   # padding words stay zero
        self.colsum = torch.zeros(P * NR, dtype=torch.int32)
        self.s, self.e, self.w = (torch.zeros(P * NR) for _ in range(3))
        lib().ur_greedy_build(w.data_ptr(), _DTYPES[w.dtype], V, K, self.codes.data_ptr(), self.colsum.data_ptr(),
                              self.s.data_ptr(), self.e.data_ptr(), self.w.data_ptr(), torch.get_num_threads())
        # the head's chain: at most 2K roundings of float32 (a tile's internal sums included)
        n = 2 * K * 2.0 ** -24
        self.gamma = n / (1 - n)
        self._scratch = torch.empty(0, dtype=torch.float32)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.colsum, self.s, self.e, self.w))

    def candidates(self, x: torch.Tensor, out_dtype: torch.dtype) -> list[torch.Tensor | None]:
        """Each row's candidate words (ascending), or None where the full head must run."""
        M = x.shape[0]
        x = x.float().contiguous()
        # the words each row keeps on the way (4 cap + 4096 of them, and their upper bounds)
        need = M * 2 * (4 * self.cap + 4096)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        # the slack for logits that tie after their rounding (and a monotone finish's own)
        rel, ab = (2.0 ** -18, 2.0 ** -60) if out_dtype is torch.float32 else (2.0 ** -5, 2.0 ** -10)
        cand = torch.empty(M, self.cap, dtype=torch.int64)
        count = torch.full((M,), -1, dtype=torch.int64)   # a row the call leaves unwritten: the full head
        lib().ur_greedy_candidates(x.data_ptr(), M, self.K, self.codes.data_ptr(), self.colsum.data_ptr(),
                                   self.s.data_ptr(), self.e.data_ptr(), self.w.data_ptr(), self.V, self.gamma,
                                   rel, ab, self._scratch.data_ptr(), cand.data_ptr(), self.cap, count.data_ptr())
        return [cand[m, :n] if n >= 0 else None for m, n in enumerate(count.tolist())]

    def argmax(self, x: torch.Tensor, finish=None) -> list[int | None]:
        """The greedy token of each row of x [M, K] (the head's input, in its dtype): the
        index torch.argmax gives over finish(linear(x, head)).float(), or None for a row
        the caller must run through the full head."""
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        cands = self.candidates(x, out_dtype)
        rows = [m for m, c in enumerate(cands) if c is not None]
        result: list[int | None] = [None] * len(cands)
        if not rows:
            return result
        panels = torch.unique(torch.cat([cands[m] for m in rows]) // NR)   # ascending
        logits = linear(x[rows], self.head.take_panels(panels))
        if finish is not None:
            logits = finish(logits)
        logits = logits.float()
        words = (panels[:, None] * NR + torch.arange(NR)).reshape(-1)
        logits[:, words >= self.V] = float("-inf")                          # a last panel's padding
        for i, m in enumerate(rows):
            row = logits[i]
            if torch.isnan(row).any():
                continue                                                    # the full head decides
            result[m] = int(words[argmax(row.contiguous())])
        return result


# ---------------------------------------------------------------------------- attention
def attention(q: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, slots: torch.Tensor, first: torch.Tensor,
              count: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [N, H, d] over keys and values in flat pools [slots, KV, d] (any of the three
    dtypes): query row r reads slots[first[r] : first[r] + count[r]]. Returns [N, H, d]
    in q's dtype (or `dtype`: float32 keeps the sums). bfloat16 queries over bfloat16 pools (a bfloat16 model's) take
    bfloat16 products, VDPBF16PS's arithmetic, and the softmax's weights rounded to
    bfloat16 before they meet the values, as torch's bfloat16 attention rounds them."""
    N, H, d = q.shape
    KV = kpool.shape[1]
    if kpool.dtype not in _DTYPES or vpool.dtype != kpool.dtype or not (kpool.is_contiguous() and vpool.is_contiguous()):
        raise ValueError("attention: the pools must be contiguous and of one dtype of float32, bfloat16, float16")
    pairs = q.dtype is torch.bfloat16 and kpool.dtype is torch.bfloat16 and d % 2 == 0
    qc = q.contiguous() if pairs else q.float().contiguous()
    out = torch.empty(N, H, d)
    s = None if sinks is None else sinks.float().contiguous()
    slots, first, count = (t.to(torch.int64).contiguous() for t in (slots, first, count))
    lib().ur_attention(qc.data_ptr(), _DTYPES[qc.dtype], N, H, d, kpool.data_ptr(), vpool.data_ptr(),
                       _DTYPES[kpool.dtype], KV, slots.data_ptr(), first.data_ptr(), count.data_ptr(), float(scale),
                       _ptr(s), out.data_ptr(), _threads())
    return out.to(dtype or q.dtype)


# ---------------------------------------------------------------------------- tables
class BlockTable:
    """Values of a function of the position, `fn(positions [n]) -> tuple of [n, ...]`,
    made in fixed blocks of BLOCK positions and kept: a position's values come from one
    call of one shape whatever positions are asked with it (torch's cos and sin round an
    element differently in the vector body and the tail of a call)."""

    BLOCK = 1024

    def __init__(self, fn, device) -> None:
        self.fn, self.device, self.parts, self.made = fn, device, None, 0

    def rows(self, pos: torch.Tensor) -> tuple:
        n = int(pos.max()) + 1 if pos.numel() else 0
        if self.made < n:
            blocks = []
            for lo in range(self.made, n, self.BLOCK):
                blocks.append(self.fn(torch.arange(lo, lo + self.BLOCK, device=self.device)))
                self.made = lo + self.BLOCK
            new = [torch.cat(cols) for cols in zip(*blocks)]
            self.parts = new if self.parts is None else [torch.cat((a, b)) for a, b in zip(self.parts, new)]
        return tuple(t.index_select(0, pos) for t in self.parts)


# ---------------------------------------------------------------------------- recurrences
def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def delta_rule(q, k, v, beta, g, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token: q, k [B, T, H, dk], v [B, T, H, dv], beta and
    g (log decay) [B, T, H], state [B, H, dk, dv]. Returns (out [B, T, H, dv], the new
    state), float32."""
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    q, k, v, beta, g = (_f32(t) for t in (q, k, v, beta, g))
    S = state.float().clone().contiguous()
    out = torch.empty(B, T, H, dv, dtype=torch.float32)
    lib().ur_delta_rule(q.data_ptr(), k.data_ptr(), v.data_ptr(), beta.data_ptr(), g.data_ptr(), S.data_ptr(),
                        out.data_ptr(), B, T, H, dk, dv, _threads())
    return out, S


def ssm_scan(x, dt, A, Bm, C, state) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's selective scan token by token: x [B, T, H, P], dt [B, T, H], A [H],
    Bm and C [B, T, H, N], state [B, H, P, N]. Returns (y [B, T, H, P], the new state),
    float32."""
    Bn, T, H, P = x.shape
    N = Bm.shape[-1]
    x, dt, A, Bm, C = (_f32(t) for t in (x, dt, A, Bm, C))
    S = state.float().clone().contiguous()
    y = torch.empty(Bn, T, H, P, dtype=torch.float32)
    lib().ur_ssm_scan(x.data_ptr(), dt.data_ptr(), A.data_ptr(), Bm.data_ptr(), C.data_ptr(), S.data_ptr(),
                      y.data_ptr(), Bn, T, H, P, N, _threads())
    return y, S


__all__ = ["NR", "OPS", "BlockTable", "GreedyHead", "fuse", "isa", "off", "PackedWeight", "PackedExperts", "PackedQuant", "linear_q", "rms_norm", "rope", "argmax", "available", "describe", "linear", "elementwise", "act_mul", "attention", "delta_rule",
           "ssm_scan", "lib"]
