"""The oracle: a whole sequence through the model with no cache at all."""
from __future__ import annotations

import torch

from .config import HybridConfig
from .layers import attend, matmul, mlp, recurrent_mix, rms_norm, rope


@torch.no_grad()
def reference_forward(cfg: HybridConfig, weights: dict, tokens) -> torch.Tensor:
    """Logits [T, vocab] for every position of `tokens`, computed from scratch."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    T = ids.shape[0]
    pos = torch.arange(T)
    x = weights["embed"][ids]
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    for kind, lw in zip(cfg.pattern, weights["layers"]):
        attn, rec = cfg.attention(kind), cfg.recurrent(kind)
        if attn is not None or rec is not None:
            h = rms_norm(x, lw["norm1"], cfg.norm_eps)
            delta = 0
            if attn is not None:
                q = rope(matmul(h, lw["wq"]).view(T, H, hd), pos, cfg.rope_theta)
                k = rope(matmul(h, lw["wk"]).view(T, KV, hd), pos, cfg.rope_theta)
                v = matmul(h, lw["wv"]).view(T, KV, hd)
                delta = matmul(attend(q, k, v, pos, pos, attn.window).reshape(T, H * hd), lw["wo"])
            if rec is not None:
                C = H * hd
                conv0 = torch.zeros(C, cfg.conv_kernel - 1, dtype=x.dtype)
                ssm0 = torch.zeros(H, cfg.state_dim, hd, dtype=x.dtype)
                out, _, _ = recurrent_mix(h, lw, conv0, ssm0, H, hd, cfg.state_dim)
                delta = delta + out
            x = x + delta
        x = x + mlp(rms_norm(x, lw["norm2"], cfg.norm_eps), lw)
    return matmul(rms_norm(x, weights["norm_f"], cfg.norm_eps), weights["head"])
