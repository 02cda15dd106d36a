"""Dense matrix products.

On the CPU, where the row-invariant kernels are built (model/kernels: every output one
chain of float32 fused multiply-adds in input order, whatever the weight's dtype and
however many rows come together), every dense weight is packed for them at load (`pack`:
a kernels.PackedWeight, or PackedExperts for an expert stack) and `dense()` multiplies
by them: a token's row is the same bits in a decode step, a prefill chunk and the
no-cache forward, in float32, bfloat16 and float16 alike, and 16-bit weights are read
as stored, converted in registers (bfloat16 weights in pairs of inputs, each pair's
odd product first as VDPBF16PS adds them, which computes it where the CPU has
AVX512-BF16; bfloat16 activations times bfloat16 weights: on AMX's tiles where the CPU
has them, at every row count, their own rounding). A plain CPU weight reaching `dense()` is packed on
the way (kept, so once per weight).

Without them (no C compiler, UNIRADIX_KERNELS=torch, another device), what follows holds:
torch's kernels in the dtype this machine multiplies fast, whose rows depend on the rows
beside them.

torch's CPU GEMM for a 16-bit dtype is fast only where the CPU has the instructions
oneDNN uses for it: bfloat16 with AVX512-BF16 or AMX, float16 only with AVX512-FP16 or
AMX-FP16. Elsewhere it is 3-10x slower than float32 (measured on an AVX512-BF16 CPU:
float16 at 64 rows 20 ms against 2 ms in float32 and 0.8 ms in bfloat16; on an AVX-512
CPU without BF16, [256, 640] @ [640, 2048]: 4.7 ms in float32, 21 ms in bfloat16, 50 ms
in float16). There a product of more than one row runs in float32:
the operands convert exactly, and only the one rounding of the result back remains. One
row (a decode step) keeps the dtype: torch's matrix-vector path is fast in any of them.

Where oneDNN multiplies the dtype fast, a weight is packed once into oneDNN's own
blocked layout (`pack`) and multiplied by its linear kernel: on the CPU that runs
float32 products 2-3x faster than torch's default BLAS (measured on an AVX-512 AMD
CPU: a 512-row [2048, 640] product 14.5 ms against 6.1 ms; the Gemma 3 270M head,
[262144, 640], at 1 and 4 rows 46 and 91 ms against 18 and 24 ms), and bfloat16 heads
2x faster; and a row gets the same value alone or among many (bfloat16 always,
float32 but for a single row over a long inner dimension), as the exactness of reuse
likes. A packed weight is a tensor in torch's mkldnn layout: its values, shape and
dtype are the dense weight's (`to_dense()` gives them back, for the witness)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .. import kernels


def dense(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b) in x's dtype, multiplied in gemm_dtype (a packed weight: by
    oneDNN, in its dtype; a kernels.PackedWeight, or any CPU weight where the kernels are
    built: by the row-invariant kernel)."""
    if isinstance(w, kernels.PackedWeight):
        return kernels.linear(x, w, b)
    if isinstance(w, kernels.PackedQuant):
        return kernels.linear_q(x, w, b)
    if _kernel_weight(w, x):
        return kernels.linear(x, _packed_on_the_way(w), b)
    if w.layout == torch._mkldnn:
        y = torch.ops.mkldnn._linear_pointwise(x.to(w.dtype), w, None if b is None else b.to(w.dtype), "none", [], "")
        return y.to(x.dtype)
    dtype = gemm_dtype(w.dtype, x.device) if x.numel() > x.shape[-1] else w.dtype
    if dtype == x.dtype == w.dtype:
        return F.linear(x, w, b)
    y = F.linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))
    return y.to(x.dtype)


def _kernel_weight(w, x) -> bool:
    """Whether the row-invariant kernel multiplies by W (a CPU weight of a dtype it reads)."""
    return (isinstance(w, torch.Tensor) and w.layout == torch.strided and w.dim() == 2 and w.device.type == "cpu"
            and x.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and kernels.available())


_PACKED: dict = {}


def _packed_on_the_way(w: torch.Tensor) -> "kernels.PackedWeight":
    """A weight that was not packed at load, packed once and kept (by the tensor itself:
    a weight replaced gets its own)."""
    key = (id(w), w.data_ptr(), tuple(w.shape), w.dtype)
    hit = _PACKED.get(key)
    if hit is None or hit[0] is not w:
        if len(_PACKED) > 4096:  # weights of models long gone
            _PACKED.clear()
        hit = _PACKED[key] = (w, kernels.PackedWeight(w))
    return hit[1]


def pack(w: torch.Tensor):
    """W [out, in] (or an expert stack [experts, out, in]) in the form the CPU multiplies
    it by: for the row-invariant kernels where they are built (any size, float32 or a
    16-bit dtype); else in oneDNN's layout for its linear kernel, where that is fast (a
    CPU tensor in float32, or a 16-bit dtype this CPU multiplies natively); else W itself."""
    if isinstance(w, torch.Tensor) and w.layout == torch.strided and w.device.type == "cpu" \
            and w.dtype in (torch.float32, torch.bfloat16, torch.float16) and w.dim() in (2, 3) \
            and kernels.available():
        return kernels.PackedWeight(w) if w.dim() == 2 else kernels.PackedExperts(w)
    if not packable(w):
        return w
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
    except (RuntimeError, AttributeError):  # a dtype this oneDNN build cannot pack; an older torch
        return w


#: elements a weight needs to be packed: below it oneDNN's per-call cost outweighs its
#: faster kernel (a [256, 640] product at one row: 14 us dense, 21 us packed); every
#: weight of a real checkpoint is above it, a test model's 64-wide ones below
PACK_MIN_ELEMENTS = 1 << 16


def packable(w) -> bool:
    """Whether `pack` would pack W."""
    return (isinstance(w, torch.Tensor) and w.layout == torch.strided and w.device.type == "cpu" and w.dim() == 2
            and w.numel() >= PACK_MIN_ELEMENTS and w.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and gemm_dtype(w.dtype, w.device) == w.dtype and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def unpack(w):
    """A packed weight as the dense tensor it holds; anything else as it is."""
    if isinstance(w, (kernels.PackedWeight, kernels.PackedExperts, kernels.PackedQuant)):
        return w.dense()
    return w.to_dense() if isinstance(w, torch.Tensor) and w.layout == torch._mkldnn else w


def is_packed(w) -> bool:
    """Whether W is in a packed form (the kernels' or oneDNN's)."""
    return isinstance(w, (kernels.PackedWeight, kernels.PackedExperts, kernels.PackedQuant)) or \
        (isinstance(w, torch.Tensor) and w.layout == torch._mkldnn)


def gemm_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a matrix product of `dtype` runs in on `device`: its own, or float32 on
    a CPU with no fast GEMM for it."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return dtype
    return dtype if fast_cpu_gemm(dtype) else torch.float32


@functools.cache
def fast_cpu_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's CPU GEMM is vectorised for `dtype` on this CPU."""
    probe = {torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
             torch.float16: ("_is_amx_fp16_supported",)}.get(dtype)
    if probe is None:
        return True
    if any(getattr(torch.cpu, name, lambda: False)() for name in probe):
        return True
    return dtype == torch.float16 and "avx512_fp16" in _cpu_flags()  # torch has no probe for it


def _cpu_flags() -> set:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


__all__ = ["dense", "pack", "packable", "unpack", "is_packed", "gemm_dtype", "fast_cpu_gemm"]
