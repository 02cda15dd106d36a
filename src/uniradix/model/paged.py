"""The cached forward: requests bring the pages and the state they reuse, and new
tokens; KV of the new tokens is written into the pools, attention reads cached plus
new (SWA only its window), and the recurrent state advances in its own slot."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import HybridConfig
from .layers import attend, mlp, recurrent_mix, rms_norm, rope


@dataclass
class PagedInput:
    """One request's step. `start` tokens are already in its pages and state; `tokens`
    are new, at positions start, start+1, ... `full_pages` / `swa_pages` hold one page
    handle per page of [0, start + len(tokens)) (-1 where a SWA page is absent: only
    the window before `start` must be there). `state_slot` holds the recurrent state at
    `start` and is advanced in place. `capture` maps positions in (start, end] to slots
    that receive a copy of the recurrent state there (checkpoints)."""

    tokens: list[int]
    start: int
    full_pages: object
    swa_pages: object = None
    state_slot: int | None = None
    capture: dict[int, int] = field(default_factory=dict)


def _gather(pool, layer: int, pages, lo: int, hi: int):
    """K and V of positions [lo, hi) from the pages that hold them."""
    P = pool.page_size
    first, last = lo // P, -(-hi // P)
    idx = torch.as_tensor(list(pages[first:last]), dtype=torch.long)
    if (idx < 0).any():
        raise ValueError(f"a page needed for positions [{lo}, {hi}) is absent")
    k = pool.k(layer)[idx].flatten(0, 1)
    v = pool.v(layer)[idx].flatten(0, 1)
    off = lo - first * P
    return k[off:off + hi - lo], v[off:off + hi - lo]


def _scatter(pool, layer: int, pages, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    P = pool.page_size
    page = torch.as_tensor([pages[p // P] for p in pos.tolist()], dtype=torch.long)
    off = pos % P
    pool.k(layer)[page, off] = k
    pool.v(layer)[page, off] = v


@torch.no_grad()
def paged_forward(cfg: HybridConfig, weights: dict, pools: dict, inputs: list[PagedInput]) -> list[torch.Tensor]:
    """Logits [len(tokens), vocab] per request. pools: "full" and "swa" KVPools keyed
    by model layer index, "mamba" a MambaStatePool, as the layer pattern needs."""
    return [_one(cfg, weights, pools, inp) for inp in inputs]


def _one(cfg, weights, pools, inp: PagedInput) -> torch.Tensor:
    ids = torch.as_tensor(list(inp.tokens), dtype=torch.long)
    T, s = ids.shape[0], inp.start
    end = s + T
    pos = torch.arange(s, end)
    H, KV, hd, W = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.window
    cuts = sorted(p - s for p in inp.capture if s < p <= end)
    x = weights["embed"][ids]
    for layer, (kind, lw) in enumerate(zip(cfg.pattern, weights["layers"])):
        h = rms_norm(x, lw["norm1"], cfg.norm_eps)
        if kind in "FS":
            q = rope((h @ lw["wq"]).view(T, H, hd), pos, cfg.rope_theta)
            k = rope((h @ lw["wk"]).view(T, KV, hd), pos, cfg.rope_theta)
            v = (h @ lw["wv"]).view(T, KV, hd)
            pool, pages = (pools["full"], inp.full_pages) if kind == "F" else (pools["swa"], inp.swa_pages)
            _scatter(pool, layer, pages, pos, k, v)
            lo = 0 if kind == "F" else max(0, s - W + 1)
            keys, vals = _gather(pool, layer, pages, lo, end)
            a = attend(q, keys, vals, pos, torch.arange(lo, end), W if kind == "S" else None)
            x = x + a.reshape(T, H * hd) @ lw["wo"]
        else:
            mp = pools["mamba"]
            conv, ssm = mp.conv(layer)[inp.state_slot], mp.state(layer)[inp.state_slot]
            outs, a = [], 0
            for b in cuts + [T]:
                if b > a:
                    o, conv, ssm = recurrent_mix(h[a:b], lw, conv, ssm, H, hd, cfg.state_dim)
                    outs.append(o)
                slot = inp.capture.get(s + b)
                if slot is not None:
                    mp.conv(layer)[slot] = conv
                    mp.state(layer)[slot] = ssm
                a = b
            mp.conv(layer)[inp.state_slot] = conv
            mp.state(layer)[inp.state_slot] = ssm
            x = x + torch.cat(outs)
        x = x + mlp(rms_norm(x, lw["norm2"], cfg.norm_eps), lw)
    return rms_norm(x, weights["norm_f"], cfg.norm_eps) @ weights["head"]
