"""Pools, tree and cache for a model config: one component per kind of layer the
pattern uses (FULL always shapes the tree; SWA and MAMBA when the pattern has them).

Sizes are checked before anything is allocated, so a size that cannot work fails at
once with a ValueError that names the flag to change: the sizing flags must be
positive (ints where they count, finite numbers where they scale), no pool may need
more handles than int32 can index, and all pools together (device pools, host
mirrors, allocators' bookkeeping) must fit the memory available where they live."""
from __future__ import annotations

import math
import numbers

import torch

from ..cache import UnifiedRadixCache
from ..memory import KVPool, MambaStatePool, PoolPlan, check_fits, host_mirror, host_sizes
from ..memory.budget import handle_count
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
    plans = plan_pools(cfg, page_size=page_size, max_total_tokens=max_total_tokens,
                       swa_full_tokens_ratio=swa_full_tokens_ratio,
                       max_mamba_cache_size=max_mamba_cache_size, device=device)
    host_plans = {}
    if hierarchical:
        if hicache_size is None:
            _finite_above(hicache_ratio, 1, "--hicache-ratio",
                          " (the host tier must be larger than the device tier)")
        else:
            _finite_above(hicache_size, 0, "--hicache-size", " (GB)")
        flags = ("--hicache-ratio",) if hicache_size is None else ("--hicache-size",)
        sizes = host_sizes(plans, ratio=hicache_ratio, size_gb=hicache_size)
        host_plans = {name: plan.host_copy(sizes[name], flags) for name, plan in plans.items()}
    check_fits([*plans.values(), *host_plans.values()])
    pools = {name: plan.build() for name, plan in plans.items()}
    comps = [FullComponent()]
    if "swa" in pools:
        comps.append(SWAComponent(cfg.window))
    if "mamba" in pools:
        comps.append(MambaComponent())
    tree = RadixTree(comps, page_size=page_size, eviction_policy=eviction_policy)
    host = None
    if hierarchical:
        host = {name: host_mirror(pool, host_plans[name].size) for name, pool in pools.items()}
    cache = UnifiedRadixCache(tree, pools, host_pools=host, write_policy=write_policy,
                              write_through_threshold=write_through_threshold)
    return cache, pools


def plan_pools(cfg: HybridConfig, *, page_size: int, max_total_tokens: int,
               swa_full_tokens_ratio: float, max_mamba_cache_size: int,
               device="cpu") -> dict[str, PoolPlan]:
    """The device pools `build_cache` makes, by name, before any exists: checked flags,
    handle counts and the shapes the pools are built with (so their cost is known)."""
    page_size = _count(page_size, "--page-size")
    max_total_tokens = _count(max_total_tokens, "--max-total-tokens")
    max_mamba_cache_size = _count(max_mamba_cache_size, "--max-mamba-cache-size")
    _finite_above(swa_full_tokens_ratio, 0, "--swa-full-tokens-ratio")
    if max_total_tokens < page_size:
        raise ValueError(f"--max-total-tokens ({max_total_tokens}) is below one page "
                         f"(--page-size {page_size})")
    device = torch.device(device)
    dtype = getattr(torch, cfg.dtype)
    full_pages = max_total_tokens // page_size
    kv_shape = dict(page_size=page_size, num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                    dtype=dtype)
    # FULL shapes the tree even for a model with no full-attention layer; then it only counts
    plans = {"full": PoolPlan("full", KVPool, tuple(cfg.layers("F") or [0]), full_pages, kv_shape,
                              device, accounting_only=not cfg.layers("F"), what="the FULL KV pool",
                              unit="pages", flags=("--max-total-tokens",))}
    if cfg.layers("S"):
        what, flags = "the SWA KV pool", ("--swa-full-tokens-ratio", "--max-total-tokens")
        swa_pages = handle_count(max(1, full_pages * swa_full_tokens_ratio), what, "pages", flags)
        plans["swa"] = PoolPlan("swa", KVPool, tuple(cfg.layers("S")), swa_pages, kv_shape, device,
                                what=what, unit="pages", flags=flags)
    if cfg.layers("M"):
        C = cfg.n_heads * cfg.head_dim
        mamba_shape = dict(conv_shape=(C, cfg.conv_kernel - 1),
                           state_shape=(cfg.n_heads, cfg.state_dim, cfg.head_dim), dtype=dtype)
        plans["mamba"] = PoolPlan("mamba", MambaStatePool, tuple(cfg.layers("M")), max_mamba_cache_size,
                                  mamba_shape, device, what="the recurrent state pool", unit="slots",
                                  flags=("--max-mamba-cache-size",))
    return plans


def _count(value, flag: str) -> int:
    """A positive int: not a bool, not a float (10.5 pages is a typo, not a size)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value}")
    return int(value)


def _finite_above(value, bound: float, flag: str, why: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            math.isfinite(value) and value > bound):
        raise ValueError(f"{flag} must be a finite number > {bound}{why}, got {value!r}")
    return float(value)
