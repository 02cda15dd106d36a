"""The reference model's layers as plain functions over explicit state, so the cached
(paged) forward and the no-cache oracle run the very same arithmetic."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tree.component import first_visible


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [T, heads, dim] at absolute positions pos [T]."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    ang = (pos.to(torch.float64)[:, None] * freq[None, :]).to(x.dtype)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [T, H, d] at q_pos; k, v [S, KV, d] at k_pos. Causal; with a window, a query at
    i sees keys from first_visible(i, window) to i (the tree's reuse rule reads the same
    definition). Grouped-query: H is a multiple of KV."""
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
    return (F.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]


def recurrent_mix(x: torch.Tensor, w: dict, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                  n_heads: int, head_dim: int, state_dim: int):
    """A gated delta-rule recurrent mixer over x [T, D], starting from conv_state
    [C, K-1] (the last K-1 conv inputs) and ssm_state [H, state_dim, head_dim].
    Returns (out [T, D], conv_state, ssm_state) after the T tokens; states at any
    position equal those of processing the prefix up to it, which is what makes a
    checkpoint resumable."""
    T = x.shape[0]
    u = x @ w["w_u"]                                   # [T, C]
    z = x @ w["w_z"]                                   # [T, C]
    K = w["conv"].shape[1]
    seq = torch.cat((conv_state.t(), u), dim=0)        # [K-1+T, C]
    conv = sum(seq[j:j + T] * w["conv"][:, j] for j in range(K))
    u = F.silu(conv).view(T, n_heads, head_dim)
    k = F.normalize((x @ w["w_k"]).view(T, n_heads, state_dim), dim=-1)
    q = (x @ w["w_q"]).view(T, n_heads, state_dim)
    a = torch.sigmoid(x @ w["w_a"])                    # [T, H] decay
    beta = torch.sigmoid(x @ w["w_b"])                 # [T, H] write strength
    s = ssm_state
    ys = []
    for t in range(T):
        s = s * a[t][:, None, None]
        pred = torch.einsum("hs,hsd->hd", k[t], s)
        s = s + beta[t][:, None, None] * torch.einsum("hs,hd->hsd", k[t], u[t] - pred)
        ys.append(torch.einsum("hs,hsd->hd", q[t], s))
    y = torch.stack(ys).reshape(T, n_heads * head_dim)
    out = (y * F.silu(z)) @ w["w_o"]
    return out, seq[-(K - 1):].t().contiguous(), s
