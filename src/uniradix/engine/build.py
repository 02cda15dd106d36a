"""Pools, tree and cache for a model config: one component per kind of layer the
pattern uses (FULL always shapes the tree; SWA and MAMBA when the pattern has them)."""
from __future__ import annotations

import torch

from ..cache import UnifiedRadixCache
from ..memory import KVPool, MambaStatePool, host_mirror, host_sizes
from ..model import HybridConfig
from ..tree import FullComponent, MambaComponent, RadixTree, SWAComponent


def build_cache(cfg: HybridConfig, *, page_size: int = 1, max_total_tokens: int = 16384,
                swa_full_tokens_ratio: float = 1.0, max_mamba_cache_size: int = 256,
                eviction_policy: str = "lru", device="cpu", hierarchical: bool = False,
                hicache_ratio: float = 2.0, hicache_size: float | None = None,
                write_policy: str = "write_through",
                write_through_threshold: int = 2) -> tuple[UnifiedRadixCache, dict]:
    """Returns the cache and the pools by name ("full", "swa", "mamba"), sized like
    SGLang's flags: FULL holds `max_total_tokens`, SWA that times the ratio, MAMBA
    `max_mamba_cache_size` state slots (running requests' states and checkpoints).
    `hierarchical` adds host mirrors of every pool (L2), `hicache_ratio` times each
    device pool, or `hicache_size` GB in all (which overrides the ratio)."""
    if page_size < 1:
        raise ValueError(f"page size must be at least 1, got {page_size}")
    if max_total_tokens < page_size:
        raise ValueError(f"max_total_tokens ({max_total_tokens}) is below one page ({page_size})")
    if swa_full_tokens_ratio <= 0:
        raise ValueError(f"swa_full_tokens_ratio must be positive, got {swa_full_tokens_ratio}")
    if max_mamba_cache_size < 1:
        raise ValueError(f"max_mamba_cache_size must be at least 1, got {max_mamba_cache_size}")
    dtype = getattr(torch, cfg.dtype)
    full_pages = max_total_tokens // page_size
    kv = dict(page_size=page_size, num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
              dtype=dtype, device=device)
    # FULL shapes the tree even for a model with no full-attention layer; then it only counts
    pools = {"full": KVPool(cfg.layers("F") or [0], full_pages, accounting_only=not cfg.layers("F"),
                            name="full", **kv)}
    comps = [FullComponent()]
    if cfg.layers("S"):
        swa_pages = max(1, int(full_pages * swa_full_tokens_ratio))
        pools["swa"] = KVPool(cfg.layers("S"), swa_pages, name="swa", **kv)
        comps.append(SWAComponent(cfg.window))
    if cfg.layers("M"):
        C = cfg.n_heads * cfg.head_dim
        pools["mamba"] = MambaStatePool(cfg.layers("M"), max_mamba_cache_size, (C, cfg.conv_kernel - 1),
                                        (cfg.n_heads, cfg.state_dim, cfg.head_dim), dtype, device)
        comps.append(MambaComponent())
    tree = RadixTree(comps, page_size=page_size, eviction_policy=eviction_policy)
    host = None
    if hierarchical:
        sizes = host_sizes(pools, ratio=hicache_ratio, size_gb=hicache_size)
        host = {name: host_mirror(pool, sizes[name]) for name, pool in pools.items()}
    cache = UnifiedRadixCache(tree, pools, host_pools=host, write_policy=write_policy,
                              write_through_threshold=write_through_threshold)
    return cache, pools
