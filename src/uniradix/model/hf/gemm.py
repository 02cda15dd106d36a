"""Dense matrix products in the dtype this machine multiplies fast.

torch's CPU GEMM for a 16-bit dtype is fast only where the CPU has the instructions
oneDNN uses for it: bfloat16 with AVX512-BF16 or AMX, float16 only with AVX512-FP16 or
AMX-FP16. Elsewhere it is 3-10x slower than float32 (measured on an AVX512-BF16 CPU:
float16 at 64 rows 20 ms against 2 ms in float32 and 0.8 ms in bfloat16; on an AVX-512
CPU without BF16, [256, 640] @ [640, 2048]: 4.7 ms in float32, 21 ms in bfloat16, 50 ms
in float16). There a product of more than one row runs in float32:
the operands convert exactly, and only the one rounding of the result back remains. One
row (a decode step) keeps the dtype: torch's matrix-vector path is fast in any of them."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def dense(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b) in x's dtype, multiplied in gemm_dtype."""
    dtype = gemm_dtype(w.dtype, x.device) if x.numel() > x.shape[-1] else w.dtype
    if dtype == x.dtype == w.dtype:
        return F.linear(x, w, b)
    y = F.linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))
    return y.to(x.dtype)


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


__all__ = ["dense", "gemm_dtype", "fast_cpu_gemm"]
