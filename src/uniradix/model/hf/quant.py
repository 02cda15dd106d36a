"""Weight-only quantized linear weights, multiplied by torch's own kernels.

A quantized weight stands where a dense [out, in] matrix stood and `ops.linear` asks it
for x @ W^T. Two schemes:

- int8: per output channel, symmetric: W ~ q * scale[:, None], q in [-127, 127].
- int4: per group of GROUP input columns, asymmetric: W ~ (c - 8) * scale + zero, c in
  [0, 15] (the convention of torch's int4 kernels).

A quantized linear multiplies in bfloat16 whatever the model's dtype: torch's packed
CPU kernels, `aten._weight_int8pack_mm` and `aten._weight_int4pack_mm_for_cpu`, are
vectorised for bfloat16 activations only (float32 and float16 take 10-40x longer). On
the CPU every row goes through them, KERNEL_ROWS rows a call, reading the weight at one
byte (half a byte) per element. Their rows are computed alike however many come
together (bit for bit: checked in tests/model/hf/test_precision.py), so a token gets
the same values in a prefill chunk, in a decode step or in the no-cache forward, and
reuse stays exact at this precision. The price is prefill: on many rows the kernels run
about 2.7x longer than bfloat16's dense GEMM (a dequantize-then-GEMM path was as fast
as the dense one, but rounds differently from the kernel, which flipped MoE routing
between a prefill and a decode of the same tokens). Off the CPU the codes are expanded
to bfloat16 and multiplied by the dense GEMM (torch has no weight-only int8 kernel for
CUDA). The result comes back in the activations' dtype.

A quantized weight keeps its codes in a device-independent layout (`tensors()`: what the
weights' witness and fingerprint read, and what moves between devices); the int4
kernel's own packing, which depends on the CPU, is derived from them on the CPU at the
first product. So int4 holds a byte per weight in memory (the codes and the packing),
as int8 does, and reads half a byte per weight per product."""
from __future__ import annotations

import torch

from ...config import QUANTIZATIONS
from .gemm import dense

#: the quantization schemes (--quantization)
SCHEMES = QUANTIZATIONS
#: int4: input columns per (scale, zero) pair; llama.cpp's Q4 formats use 32 too
GROUP = 32
#: rows per call of a packed kernel (one call on more rows takes longer than the same
#: rows in calls of this many: measured on [2048, 640] at 64 rows, 6 ms against 2.3 ms)
KERNEL_ROWS = 32
#: the dtype the packed CPU kernels run in (their vectorised path)
KERNEL_DTYPE = torch.bfloat16


class QuantizedWeight:
    """A weight W [out, in] as `scheme` codes: `linear(x)` is x @ W^T (ops.linear)."""

    scheme = "?"

    @property
    def shape(self) -> torch.Size:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors().values())).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its scales (what its dequantized values are exact in)."""
        return KERNEL_DTYPE

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that define it (device-independent), by name."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] as the kernels see it, in `dtype`."""
        raise NotImplementedError

    def to(self, device) -> "QuantizedWeight":
        raise NotImplementedError

    def kernel(self, x2: torch.Tensor) -> torch.Tensor | None:
        """x2 [rows, in] (KERNEL_DTYPE) through the packed kernel; None where it has none."""
        return None

    def dense_linear(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [rows, in] (KERNEL_DTYPE) @ the dequantized weight^T, by the dense GEMM."""
        return dense(x2, self.dequantize(KERNEL_DTYPE))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ W^T -> [..., out] in x's dtype, multiplied in KERNEL_DTYPE: on
        the CPU through the packed kernel, KERNEL_ROWS rows at a time."""
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if x2.dtype != KERNEL_DTYPE:
            x2 = x2.to(KERNEL_DTYPE)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = None
        rows = x2.shape[0]
        if x2.device.type == "cpu" and rows:
            if rows <= KERNEL_ROWS:  # a decode step: one call, nothing to slice or join
                y = self.kernel(x2)
            else:
                parts = [self.kernel(x2[i:i + KERNEL_ROWS]) for i in range(0, rows, KERNEL_ROWS)]
                y = None if parts[0] is None else torch.cat(parts)
        if y is None:
            y = self.dense_linear(x2)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({tuple(self.shape)})"


class Int8Weight(QuantizedWeight):
    """Per output channel symmetric int8: q int8 [out, in], scale [out] (bfloat16)."""

    scheme = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        if q.dtype != torch.int8 or q.dim() != 2 or tuple(scale.shape) != (q.shape[0],):
            raise ValueError(f"int8 weight: codes must be int8 [out, in] with a scale per row, got {q.dtype} "
                             f"{tuple(q.shape)} and {tuple(scale.shape)}")
        self.q, self.scale = q.contiguous(), scale.to(KERNEL_DTYPE).contiguous()

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Weight":
        w = w.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(KERNEL_DTYPE)
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def tensors(self):
        return {"q": self.q, "scale": self.scale}

    def dequantize(self, dtype=torch.float32):
        return (self.q.to(dtype) * self.scale.to(dtype)[:, None]).to(dtype)

    def to(self, device):
        return Int8Weight(self.q.to(device), self.scale.to(device))

    def dense_linear(self, x2):
        # the codes are exact in bfloat16; the scale applies after the sum, as in the kernel
        return dense(x2, self.q.to(KERNEL_DTYPE)) * self.scale

    def kernel(self, x2):
        if self.q.shape[1] % 16:  # the kernel reads the input in blocks of 16 (and crashes otherwise)
            return None
        return torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scale)


class Int4Weight(QuantizedWeight):
    """Groupwise asymmetric int4: codes uint8 [out, in / 2] (column 2j in the low nibble,
    2j + 1 in the high one), scale_zero [in / group, out, 2] (bfloat16). The CPU kernel's
    packing of the codes is built once, on the CPU."""

    scheme = "int4"

    def __init__(self, codes: torch.Tensor, scale_zero: torch.Tensor, group: int = GROUP) -> None:
        out, half = codes.shape
        if codes.dtype != torch.uint8 or tuple(scale_zero.shape) != (2 * half // group, out, 2):
            raise ValueError(f"int4 weight: codes must be uint8 [out, in / 2] with scale_zero [in / {group}, out, 2],"
                             f" got {codes.dtype} {tuple(codes.shape)} and {tuple(scale_zero.shape)}")
        self.codes, self.scale_zero, self.group = codes.contiguous(), scale_zero.to(KERNEL_DTYPE).contiguous(), group
        self._packed = None

    @staticmethod
    def fits(shape) -> bool:
        """Whether torch's int4 kernel takes a weight of this shape (rows a multiple of 16,
        columns a multiple of the group)."""
        out, cols = shape
        return out % 16 == 0 and cols % GROUP == 0 and cols > 0

    @classmethod
    def quantize(cls, w: torch.Tensor, group: int = GROUP) -> "Int4Weight":
        out, cols = w.shape
        g = w.detach().float().reshape(out, cols // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(KERNEL_DTYPE).float()
        zero = (lo + 8 * scale).to(KERNEL_DTYPE).float()
        c = torch.round((g - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.uint8).reshape(out, cols)
        codes = c[:, 0::2] | (c[:, 1::2] << 4)
        return cls(codes, torch.stack((scale, zero), dim=-1).transpose(0, 1), group)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], 2 * self.codes.shape[1]))

    def tensors(self):
        return {"codes": self.codes, "scale_zero": self.scale_zero}

    def unpacked(self) -> torch.Tensor:
        """The codes c [out, in] (int32, 0-15)."""
        c = self.codes
        return torch.stack((c & 15, c >> 4), dim=-1).reshape(c.shape[0], -1).to(torch.int32)

    def dequantize(self, dtype=torch.float32):
        out, cols = self.shape
        sz = self.scale_zero.to(dtype)
        c = self.unpacked().reshape(out, cols // self.group, self.group).to(dtype)
        return ((c - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]).reshape(out, cols)

    def to(self, device):
        return Int4Weight(self.codes.to(device), self.scale_zero.to(device), self.group)

    def kernel(self, x2):
        if self._packed is None:
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.unpacked(), 1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self._packed, self.group, self.scale_zero)


class QuantizedExperts:
    """A stack of experts' weights [experts, out, in], each quantized on its own:
    `stack[e]` is expert e's QuantizedWeight."""

    def __init__(self, experts: list[QuantizedWeight]) -> None:
        self.experts = list(experts)

    def __getitem__(self, e: int) -> QuantizedWeight:
        return self.experts[e]

    def __len__(self) -> int:
        return len(self.experts)

    @property
    def scheme(self) -> str:
        return self.experts[0].scheme

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.experts), *self.experts[0].shape))

    @property
    def device(self) -> torch.device:
        return self.experts[0].device

    def tensors(self):
        return {f"{e}.{k}": t for e, w in enumerate(self.experts) for k, t in w.tensors().items()}

    def dequantize(self, dtype=torch.float32):
        return torch.stack([w.dequantize(dtype) for w in self.experts])

    def to(self, device):
        return QuantizedExperts([w.to(device) for w in self.experts])

    def __repr__(self) -> str:
        return f"QuantizedExperts({len(self.experts)} x {self.experts[0]!r})"


def stored_scheme(bits: float | None) -> str:
    """The scheme nearest a weight stored at `bits` per weight (`--quantization stored`):
    int4 under 5 bits (Q4_0, Q4_K, ...), int8 up to 8 and a block scale (Q5 ... Q8_0),
    dense above (float types) or when unknown."""
    if bits is None or bits > 9:
        return "none"
    return "int4" if bits < 5 else "int8"


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ValueError(f"quantization {scheme!r} is not one of {', '.join(SCHEMES)}")
    return scheme


def quantize(w: torch.Tensor, scheme: str):
    """W [out, in] (or a stack [experts, out, in]) in `scheme`'s form; the dense tensor
    itself for "none". int4 takes only the shapes its kernel does (Int4Weight.fits);
    other weights fall back to int8."""
    if check_scheme(scheme) == "stored":
        raise ValueError("quantization 'stored' is chosen per tensor (stored_scheme), not for one weight")
    if scheme == "none":
        return w
    if not w.is_floating_point() or w.dim() not in (2, 3):
        raise ValueError(f"only a floating-point matrix (or a stack of them) is quantized, got {w.dtype} "
                         f"{tuple(w.shape)}")
    if w.dim() == 3:
        return QuantizedExperts([quantize(m, scheme) for m in w.unbind(0)])
    if scheme == "int4" and Int4Weight.fits(w.shape):
        return Int4Weight.quantize(w)
    return Int8Weight.quantize(w)


def is_quantized(w) -> bool:
    return isinstance(w, (QuantizedWeight, QuantizedExperts))


__all__ = ["SCHEMES", "stored_scheme", "GROUP", "KERNEL_ROWS", "KERNEL_DTYPE", "QuantizedWeight", "Int8Weight", "Int4Weight",
           "QuantizedExperts", "quantize", "is_quantized", "check_scheme"]
