"""The reference model's layers as plain functions over explicit state, so the cached
(paged) forward and the no-cache oracle run the very same arithmetic. On the CPU the
products, activations and attention go through the row-invariant kernels (model/kernels)
and RoPE reads a table made in fixed blocks, so a token's values are the same bits
whatever rows are computed beside it: the paged forward equals the oracle bit for bit."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..tree.component import first_visible
from . import kernels


def _kernels(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and kernels.available()


_PACKED: dict = {}


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w [in, out]: by the row-invariant kernel on the CPU (w^T packed once
    per weight and kept)."""
    if not _kernels(x) or w.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w.dim() != 2:
        return x @ w
    key = (id(w), w.data_ptr(), tuple(w.shape), w.dtype)
    hit = _PACKED.get(key)
    if hit is None or hit[0] is not w:
        if len(_PACKED) > 4096:  # weights of models long gone
            _PACKED.clear()
        hit = _PACKED[key] = (w, kernels.PackedWeight(w.t().contiguous()))
    return kernels.linear(x, hit[1])


def silu(x: torch.Tensor) -> torch.Tensor:
    return kernels.elementwise("silu", x) if _kernels(x) else F.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return kernels.elementwise("sigmoid", x) if _kernels(x) else torch.sigmoid(x)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


_ROPE: dict = {}


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [T, heads, dim] at absolute positions pos [T] (angles in
    float64, rounded to x's dtype, their cos and sin from a table of fixed blocks)."""
    half = x.shape[-1] // 2
    key = (half, theta, x.dtype, str(x.device))
    table = _ROPE.get(key)
    if table is None:
        freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)

        def angles(p, freq=freq, dtype=x.dtype):
            ang = (p.to(torch.float64)[:, None] * freq[None, :]).to(dtype)
            return ang.cos(), ang.sin()
        table = _ROPE[key] = kernels.BlockTable(angles, x.device)
    cos, sin = table.rows(pos.to(torch.long))
    cos, sin = cos[:, None, :], sin[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [T, H, d] at q_pos; k, v [S, KV, d] at k_pos. Causal; with a window, a query at
    i sees keys from first_visible(i, window) to i (the tree's reuse rule reads the same
    definition). Grouped-query: H is a multiple of KV. k_pos are consecutive positions."""
    if _kernels(q) and len(k_pos) and q.dtype in (torch.float32, torch.bfloat16, torch.float16) \
            and v.shape[-1] == q.shape[-1]:  # the kernel's values are as wide as its keys
        lo = k_pos[0]
        start = q_pos - q_pos + lo if window is None else torch.clamp(first_visible(q_pos, window), min=lo)
        count = torch.clamp(q_pos - start + 1, min=0)
        keys = torch.arange(len(k_pos), device=q.device)
        kv = k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()
        return kernels.attention(q, *kv, keys, start - lo, count, 1.0 / math.sqrt(q.shape[-1]))
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] >= first_visible(q_pos[:, None], window)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def mlp(x: torch.Tensor, w: dict) -> torch.Tensor:
    return matmul(silu(matmul(x, w["w_gate"])) * matmul(x, w["w_up"]), w["w_down"])


def recurrent_mix(x: torch.Tensor, w: dict, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                  n_heads: int, head_dim: int, state_dim: int):
    """A gated delta-rule recurrent mixer over x [T, D], starting from conv_state
    [C, K-1] (the last K-1 conv inputs) and ssm_state [H, state_dim, head_dim].
    Returns (out [T, D], conv_state, ssm_state) after the T tokens; states at any
    position equal those of processing the prefix up to it, which is what makes a
    checkpoint resumable."""
    T = x.shape[0]
    u = matmul(x, w["w_u"])                            # [T, C]
    z = matmul(x, w["w_z"])                            # [T, C]
    K = w["conv"].shape[1]
    seq = torch.cat((conv_state.t(), u), dim=0)        # [K-1+T, C]
    conv = sum(seq[j:j + T] * w["conv"][:, j] for j in range(K))
    u = silu(conv).view(T, n_heads, head_dim)
    k = F.normalize(matmul(x, w["w_k"]).view(T, n_heads, state_dim), dim=-1)
    q = matmul(x, w["w_q"]).view(T, n_heads, state_dim)
    a = sigmoid(matmul(x, w["w_a"]))                   # [T, H] decay
    beta = sigmoid(matmul(x, w["w_b"]))                # [T, H] write strength
    s = ssm_state
    ys = []
    for t in range(T):
        s = s * a[t][:, None, None]
        pred = torch.einsum("hs,hsd->hd", k[t], s)
        s = s + beta[t][:, None, None] * torch.einsum("hs,hd->hsd", k[t], u[t] - pred)
        ys.append(torch.einsum("hs,hsd->hd", q[t], s))
    y = torch.stack(ys).reshape(T, n_heads * head_dim)
    out = matmul(y * silu(z), w["w_o"])
    return out, seq[-(K - 1):].t().contiguous(), s
