"""Deterministic weights from a seed (or a safetensors file), one dict per layer."""
from __future__ import annotations

import torch

from .config import HybridConfig


def init_weights(cfg: HybridConfig) -> dict:
    """Same seed, same weights, on every machine: drawn on the CPU in float64, then cast."""
    g = torch.Generator().manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)

    def w(*shape, scale=None):
        fan_in = shape[0]
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * (scale or fan_in ** -0.5)
        return t.to(dtype)

    D, H, KV, hd, sd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.state_dim
    out = {"embed": w(cfg.vocab_size, D, scale=1.0), "norm_f": torch.ones(D, dtype=dtype),
           "head": w(D, cfg.vocab_size), "layers": []}
    for kind in cfg.pattern:
        lw = {"norm1": torch.ones(D, dtype=dtype), "norm2": torch.ones(D, dtype=dtype),
              "w_gate": w(D, cfg.mlp_hidden), "w_up": w(D, cfg.mlp_hidden), "w_down": w(cfg.mlp_hidden, D)}
        if kind in "FS":
            lw.update(wq=w(D, H * hd), wk=w(D, KV * hd), wv=w(D, KV * hd), wo=w(H * hd, D))
        else:
            C = H * hd
            lw.update(w_u=w(D, C), w_z=w(D, C), w_k=w(D, H * sd), w_q=w(D, H * sd),
                      w_a=w(D, H), w_b=w(D, H), w_o=w(C, D),
                      conv=w(C, cfg.conv_kernel, scale=cfg.conv_kernel ** -0.5))
        out["layers"].append(lw)
    return out
