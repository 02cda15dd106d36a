"""A GGUF tensor's quantized blocks as codes and per-group scales, for the kernels that
read weights as the file stores them (`--quantization stored`: kernels.PackedQuant).

Every format read here dequantizes as w = a * (u - off) + b per group of G inputs: u the
stored code (4 to 8 bits), a and b the group's scale and offset, computed here in the
order and precision the `gguf` library's own dequantization computes them (float32
products of the file's float16 scales and small integers), so that fma(a, u - off, b) is
bit for bit the float32 weight `gguf.quants.dequantize` gives (a * (u - off) is exact
in every format but Q6_K, whose one rounding is the same; tests/model/hf/test_gguf_blocks.py
checks each format against the library). Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 per
block), Q4_K, Q5_K (8 groups of 32 per 256), Q6_K (16 groups of 16 per 256)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Codes:
    """u [N, K] (uint8; int8 for 8-bit codes), a and b [N, K / group] float32 (b None:
    zero), `off` subtracted from u, `bits` per code."""

    u: np.ndarray
    a: np.ndarray
    b: np.ndarray | None
    off: float
    bits: int
    group: int


def _f16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n: int) -> np.ndarray:
    """[nb, n/2] bytes -> [nb, n]: the low nibbles of the bytes, then their high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).reshape(qs.shape[0], n)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The K-quants' eight 6-bit scales and mins packed in 12 bytes (as gguf unpacks them)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode(type_name: str, raw: np.ndarray, n: int, k: int) -> Codes | None:
    """The codes of a tensor [n, k] (rows of k inputs) from its raw blocks (uint8, the
    file's bytes in row order); None for a format not read here."""
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if type_name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}[type_name]
        b = raw.reshape(-1, size)
        d = _f16(b[:, 0:2])[:, 0]
        if type_name == "Q8_0":
            return Codes(b[:, 2:].view(np.int8).reshape(n, k), d.reshape(n, -1), None, 0.0, 8, 32)
        m = _f16(b[:, 2:4])[:, 0] if type_name in ("Q4_1", "Q5_1") else None
        start = 4 if m is not None else 2
        if type_name in ("Q4_0", "Q4_1"):
            u = _nibbles(b[:, start:start + 16], 32)
            bits = 4
        else:
            qh = np.ascontiguousarray(b[:, start:start + 4]).view(np.uint32)            # [nb, 1]
            hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)        # [nb, 32]
            u = _nibbles(b[:, start + 4:start + 20], 32) | (hi << 4)
            bits = 5
        off = {"Q4_0": 8.0, "Q5_0": 16.0}.get(type_name, 0.0)
        return Codes(u.reshape(n, k), d.reshape(n, -1), None if m is None else m.reshape(n, -1), off, bits, 32)
    if type_name in ("Q4_K", "Q5_K"):
        size = 144 if type_name == "Q4_K" else 176
        b = raw.reshape(-1, size)
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])                                   # [nb, 1]
        sc, mn = _scale_min_k4(b[:, 4:16])
        a = d * sc.astype(np.float32)                                                # [nb, 8]
        dm = dmin * mn.astype(np.float32)
        qs = b[:, -128:].reshape(-1, 4, 32)
        u = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)                  # 8 groups of 32
        if type_name == "Q5_K":
            qh = b[:, 16:48]                                                         # [nb, 32]
            hi = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(-1, 256)
            u = u | (hi << 4)
        return Codes(u.reshape(n, k), a.reshape(n, -1), (-dm).reshape(n, -1), 0.0, 4 if type_name == "Q4_K" else 5,
                     32)
    if type_name == "Q6_K":
        b = raw.reshape(-1, 210)
        ql, qh = b[:, 0:128], b[:, 128:192]
        scales = b[:, 192:208].view(np.int8).astype(np.float32)                      # [nb, 16]
        d = _f16(b[:, 208:210])                                                      # [nb, 1]
        a = d * scales
        lo = np.stack([ql.reshape(-1, 2, 64) & 0x0F, ql.reshape(-1, 2, 64) >> 4], axis=2).reshape(-1, 8, 32)
        hi = ((qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3)
        u = lo | (hi.reshape(-1, 8, 32) << 4)
        return Codes(u.reshape(n, k), a.reshape(n, -1), None, 32.0, 6, 16)
    return None


def dequantize(c: Codes) -> np.ndarray:
    """The float32 weights the codes stand for, as the kernels make them: fma(a, u - off,
    b), which is a * (u - off) + b in float32 (the product is exact but in Q6_K, which has
    no b: one rounding either way)."""
    g = c.group
    w = np.repeat(c.a, g, axis=1) * (c.u.astype(np.float32) - np.float32(c.off))
    if c.b is not None:
        w = w + np.repeat(c.b, g, axis=1)
    return w


__all__ = ["Codes", "decode", "dequantize"]
