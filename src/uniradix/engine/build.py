"""Pools, tree and cache for a model: one component per kind of state its layers keep
(FULL always shapes the tree), each pool and tree rule made by its spec.

Sizes are checked before anything is allocated, so a size that cannot work fails at
once with a ValueError that names the flag to change: the settings are checked by their
config (uniradix.config), no pool may need more handles than int32 can index, and all
pools together (device pools, host mirrors, allocators' bookkeeping) must fit the memory
available where they live."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..cache import UnifiedRadixCache
from ..config import CacheConfig, HostTierConfig
from ..memory import PoolPlan, check_fits, host_mirror, host_sizes
from ..memory.budget import handle_count
from ..tree import RadixTree


def build_cache(model, cache: CacheConfig | None = None, host: HostTierConfig | None = None, *,
                device="cpu", max_running: int = 16, accounting_only: bool = False,
                **settings) -> tuple[UnifiedRadixCache, dict]:
    """The cache for `model` (anything with `states()`: its layers grouped by spec) and
    its device pools by component name. `cache` / `host`: the settings (or `settings` by
    name: page_size, max_total_tokens, ..., enable_hierarchical_cache, hicache_ratio, ...).
    FULL holds --max-total-tokens, SWA that times the ratio, the recurrent state pool
    --max-mamba-cache-size slots (default 4 x max_running + 64); with the host tier, host
    mirrors of every pool, --hicache-ratio times each or --hicache-size GB in all.
    `accounting_only`: pools that count handles and hold no tensors (what a simulator
    replays on: every size and byte figure stays the real model's)."""
    cache, host = _configs(cache, host, settings)
    plans = plan_pools(model, cache, device=device, max_running=max_running)
    host_plans = {}
    if host.enable_hierarchical_cache:
        flags = ("--hicache-ratio",) if host.hicache_size is None else ("--hicache-size",)
        sizes = host_sizes(plans, ratio=host.hicache_ratio, size_gb=host.hicache_size)
        host_plans = {name: plan.host_copy(sizes[name], flags) for name, plan in plans.items()}
    if accounting_only:  # after the host sizes: --hicache-size prices the real tensors
        plans = {name: replace(plan, accounting_only=True) for name, plan in plans.items()}
        host_plans = {name: replace(plan, accounting_only=True) for name, plan in host_plans.items()}
    check_fits([*plans.values(), *host_plans.values()])
    pools = {name: plan.build() for name, plan in plans.items()}
    tree = RadixTree([spec.tree_component() for spec in model.states().specs], page_size=cache.page_size,
                     eviction_policy=cache.radix_eviction_policy)
    mirrors = None
    if host.enable_hierarchical_cache:
        mirrors = {name: host_mirror(pool, host_plans[name].size) for name, pool in pools.items()}
    return UnifiedRadixCache(tree, pools, host_pools=mirrors, write_policy=host.hicache_write_policy,
                             write_through_threshold=host.write_through_threshold), pools


def _configs(cache, host, settings) -> tuple[CacheConfig, HostTierConfig]:
    from dataclasses import fields
    names = {f.name for f in fields(CacheConfig)}
    mine = {k: v for k, v in settings.items() if k in names}
    theirs = {k: v for k, v in settings.items() if k not in names}
    cache = replace(cache, **mine) if cache is not None else CacheConfig(**mine)
    host = replace(host, **theirs) if host is not None else HostTierConfig(**theirs)
    return cache, host


def plan_pools(model, cache: CacheConfig, *, device="cpu", max_running: int = 16) -> dict[str, PoolPlan]:
    """The device pools `build_cache` makes, by component name, before any exists:
    handle counts and the shapes each spec builds its pool with from the model's layers
    (so their cost is known)."""
    device = torch.device(device)
    plans = {}
    for spec, layers in model.states().groups:
        size, flags, what, unit = spec.pool_size(cache, max_running, cache.page_size)
        size = handle_count(size, what, unit, flags)
        plans[spec.name] = spec.pool_plan(list(layers), page_size=cache.page_size, size=size, device=device,
                                          what=what, flags=flags)
    return plans
