"""Pools, tree and cache for a model: one component per kind of state its layers keep
(FULL always shapes the tree), each pool and tree rule made by its spec.

The KV pools share one budget, SGLang's: --max-total-tokens tokens in every KV layer
(what the pools cost when every layer keeps every token). The windowed pools are sized
first, by their spec (--swa-full-tokens-ratio of FULL when given, else from the
workload: the running requests' windows, a prefill chunk and the windows the tree
caches at sequence ends), and FULL takes what they leave: a window layer needs only its window, so the
bytes it does not need hold more full-attention tokens (`kv_split`, said at start-up by
`describe_split`).

Sizes are checked before anything is allocated, so a size that cannot work fails at
once with a ValueError that names the flag to change: the settings are checked by their
config (uniradix.config), no pool may need more handles than int32 can index, a window
pool must hold at least one window and a page, and all pools together (device pools,
host mirrors, allocators' bookkeeping) must fit the memory available where they live."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..cache import UnifiedRadixCache
from ..config import CacheConfig, HostTierConfig, SchedulerConfig
from ..memory import PoolPlan, check_fits, host_mirror, host_sizes
from ..memory.budget import handle_count
from ..specs.spec import PoolSizing
from ..tree import RadixTree

_CHUNK = SchedulerConfig().chunked_prefill_size


def build_cache(model, cache: CacheConfig | None = None, host: HostTierConfig | None = None, *,
                device="cpu", max_running: int = 16, chunk: int = _CHUNK, context_length: int | None = None,
                accounting_only: bool = False, **settings) -> tuple[UnifiedRadixCache, dict]:
    """The cache for `model` (anything with `states()`: its layers grouped by spec) and
    its device pools by component name. `cache` / `host`: the settings (or `settings` by
    name: page_size, max_total_tokens, ..., enable_hierarchical_cache, hicache_ratio, ...).
    The KV pools split the budget (`kv_split`: the workload is `max_running` requests of
    up to `context_length` tokens, default the model's, `chunk` prefill tokens a step);
    the recurrent state pool holds --max-mamba-cache-size slots (default 4 x max_running
    + 64); with the host tier, host mirrors of every pool, --hicache-ratio times each or
    --hicache-size GB in all. `accounting_only`: pools that count handles and hold no
    tensors (what a simulator replays on: every size and byte figure stays the real
    model's)."""
    cache, host = _configs(cache, host, settings)
    plans = plan_pools(model, cache, device=device, max_running=max_running, chunk=chunk,
                       context_length=context_length)
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
    spare = spare_windows(model, cache)
    tree = RadixTree([spec.tree_component(spare) for spec in model.states().specs], page_size=cache.page_size,
                     eviction_policy=cache.radix_eviction_policy)
    mirrors = None
    if host.enable_hierarchical_cache:
        mirrors = {name: host_mirror(pool, host_plans[name].size) for name, pool in pools.items()}
    return UnifiedRadixCache(tree, pools, host_pools=mirrors, write_policy=host.hicache_write_policy,
                             write_through_threshold=host.write_through_threshold), pools


def spare_windows(model, cache: CacheConfig) -> bool:
    """Whether the window pools keep every page of a prompt as spares (--swa-retention
    spare): not beside a recurrent state, since a window without a checkpoint at the
    same boundary resumes nothing."""
    specs = model.states().specs
    return cache.swa_retention == "spare" and not any(s.checkpoint for s in specs)


def _configs(cache, host, settings) -> tuple[CacheConfig, HostTierConfig]:
    from dataclasses import fields
    names = {f.name for f in fields(CacheConfig)}
    mine = {k: v for k, v in settings.items() if k in names}
    theirs = {k: v for k, v in settings.items() if k not in names}
    cache = replace(cache, **mine) if cache is not None else CacheConfig(**mine)
    host = replace(host, **theirs) if host is not None else HostTierConfig(**theirs)
    return cache, host


def plan_pools(model, cache: CacheConfig, *, device="cpu", max_running: int = 16, chunk: int = _CHUNK,
               context_length: int | None = None) -> dict[str, PoolPlan]:
    """The device pools `build_cache` makes, by component name, before any exists:
    handle counts (the KV budget split by `kv_split`) and the shapes each spec builds
    its pool with from the model's layers (so their cost is known)."""
    device = torch.device(device)
    split = kv_split(model, cache, max_running=max_running, chunk=chunk, context_length=context_length)
    plans = {}
    for spec, layers in model.states().groups:
        size, flags, what, unit = split.sizes[spec.name]
        size = handle_count(size, what, unit, flags)
        plans[spec.name] = spec.pool_plan(list(layers), page_size=cache.page_size, size=size, device=device,
                                          what=what, flags=flags)
    return plans


@dataclass(frozen=True)
class KVSplit:
    """The KV budget and how it is split. `budget`: bytes, --max-total-tokens tokens
    in every KV layer; `sizes`: each spec's (handles, flags, what, unit) by name;
    `page_bytes`: what one page of each KV pool takes (0: it only counts); `layers`:
    how many layers each keeps; `ratio`: --swa-full-tokens-ratio as given (None:
    derived); `demand`: a derived window pool's need by part (spec.demand); `specs`:
    the specs by name; `spare`: the window pools keep every page of a prompt as
    spares (spare_windows)."""

    page_size: int
    max_total_tokens: int
    budget: int
    ratio: float | None
    sizes: dict
    page_bytes: dict
    layers: dict
    demand: dict
    specs: dict
    spare: bool = False


def kv_split(model, cache: CacheConfig, *, max_running: int = 16, chunk: int = _CHUNK,
             context_length: int | None = None) -> KVSplit:
    """Each pool's handles. The windowed KV pools are sized by their specs from a
    PoolSizing (the ratio of FULL, or the workload), and FULL gets the most pages that
    the budget leaves: the largest F with F pages of FULL plus the others' pools (sized
    at F) within --max-total-tokens tokens in every KV layer. So the 1:1 ratio gives
    --max-total-tokens to each pool, as before, and a window pool below it gives the
    bytes it leaves to FULL. Where FULL keeps no layer (its pool only counts) there is
    nothing to give them to: FULL counts --max-total-tokens and the windows keep the
    whole budget (derived is 1:1). The recurrent state pool is sized apart (its own
    flag). A window pool that cannot hold one window and a page to decode into is
    refused: no request longer than it could ever finish."""
    P = cache.page_size
    ref = cache.max_total_tokens // P
    context_length = context_length if context_length is not None else getattr(model, "context_length", None)
    groups = model.states().groups
    specs = {spec.name: spec for spec, _ in groups}
    layers = {spec.name: len(ls) for spec, ls in groups}
    page_bytes = {spec.name: _page_bytes(spec, ls, P) for spec, ls in groups if not spec.checkpoint}
    kv = [spec for spec, _ in groups if not spec.checkpoint]
    full, windows = kv[0], kv[1:]
    ratio = cache.swa_full_tokens_ratio
    in_force = 1.0 if ratio is None and not page_bytes[full.name] else ratio

    def sizing(F: int) -> PoolSizing:
        return PoolSizing(cache, F, chunk, context_length, in_force)

    def cost(F: int) -> int | None:
        """Bytes of the KV pools with F pages of FULL; None: a pool past what one can index."""
        try:
            others = [spec.pool_size(sizing(F), max_running, P)[0] for spec in windows]
        except ValueError:
            return None
        return F * page_bytes[full.name] + sum(n * page_bytes[s.name] for n, s in zip(others, windows))

    budget = ref * sum(page_bytes.values())
    F = ref
    if windows and page_bytes[full.name] and cost(ref) is not None:  # (None: past what a pool can index, said below)
        lo, hi = 1, max(1, budget // page_bytes[full.name])
        while lo < hi:  # the cost grows with F: the largest F within the budget
            mid = (lo + hi + 1) // 2
            c = cost(mid)
            if c is not None and c <= budget:
                lo = mid
            else:
                hi = mid - 1
        F = lo
    sizes = {}
    for spec, _ in groups:
        if spec is full:
            sizes[spec.name] = (F, *full.pool_size(cache, max_running, P)[1:])
        else:
            sizes[spec.name] = spec.pool_size(sizing(F), max_running, P)
    demand = {}
    for spec in windows:
        if in_force is None and hasattr(spec, "demand"):
            demand[spec.name] = spec.demand(sizing(F), max_running, P)
        n, _, what, _ = sizes[spec.name]
        floor = min(spec.window_pages(P) + 1, F) if hasattr(spec, "window_pages") and page_bytes[spec.name] else 0
        if n < floor:
            raise ValueError(f"{what} would hold {n} pages, fewer than one {spec.window}-token window and a page "
                             f"to decode into ({floor} pages at page size {P}): no request longer than it could "
                             f"ever finish; raise --swa-full-tokens-ratio, or leave it out (derived from the "
                             f"workload)")
    return KVSplit(P, cache.max_total_tokens, budget, ratio, sizes, page_bytes, layers, demand, specs,
                   spare_windows(model, cache))


def _page_bytes(spec, layers, page_size: int) -> int:
    """What one page of the spec's pool over `layers` takes (0 without layers: it only counts)."""
    if not layers:
        return 0
    plan = spec.pool_plan(list(layers), page_size=page_size, size=1, device=torch.device("cpu"), what="", flags=())
    return plan.bytes_per_handle


def describe_split(split: KVSplit) -> str:
    """The start-up line of the KV pools: tokens each holds and what it takes, why a
    window pool has its size, and what one cached token costs across all layers."""
    P = split.page_size
    kv = [name for name in split.page_bytes]
    nlayers = sum(split.layers[n] for n in kv if split.page_bytes[n])
    parts = []
    for name in kv:
        n = split.sizes[name][0]
        b = split.page_bytes[name]
        if not b:
            parts.append(f"{name.upper()} {n * P:,} tokens (counted only: no layer keeps it)")
            continue
        part = f"{name.upper()} {n * P:,} tokens x {split.layers[name]} layers = {size_text(n * b)}"
        spec = split.specs[name]
        if getattr(spec, "window", None) is not None:
            part += f" ({_why(split, name)})"
        parts.append(part)
    full = kv[0]
    per_token = split.page_bytes[full] / P
    every = sum(split.page_bytes.values()) / P
    line = (f"KV pools, {size_text(sum(split.sizes[n][0] * split.page_bytes[n] for n in kv))} "
            f"(--max-total-tokens {split.max_total_tokens:,} in each of {nlayers} KV layers): " + ", ".join(parts))
    windows = [n for n in kv[1:] if split.page_bytes[n]]
    if per_token and windows:
        kept = "; ".join(f"{n.upper()} {_bytes(split.page_bytes[n] / P)} a token for the "
                         f"{split.specs[n].window - 1:,} tokens before each sequence end or junction it keeps "
                         f"({_bytes(split.page_bytes[n] / P * (split.specs[n].window - 1))})" for n in windows)
        line += (f"; a cached token costs {_bytes(per_token)} in the full-attention layers ({_bytes(every)} if every "
                 f"layer kept it), and the window layers {kept}")
        if split.spare:
            line += ", and every other page of a prompt as a spare while the pool has room (--swa-retention spare)"
    return line


def _why(split: KVSplit, name: str) -> str:
    full = split.sizes[next(iter(split.page_bytes))][0]
    n = split.sizes[name][0]
    if split.ratio is not None:
        return f"--swa-full-tokens-ratio {split.ratio:g}"
    need = split.demand.get(name)
    spec, P = split.specs[name], split.page_size
    ratio = f"{n / full:.3g} of FULL" if full else "1:1"
    if need is None:
        return "1:1"
    running = need["running"] // spec.window_pages(P)
    what = (f"the windows of {running} running requests, a {(need['chunk'] - 1) * P:,}-token prefill chunk "
            f"and {need['cached'] * P:,} tokens of cached windows, one per {spec.CACHED_WINDOWS} windows of FULL")
    if n < sum(need.values()):
        return f"1:1, short of {what} ({sum(need.values()) * P:,} tokens)"
    return f"derived, {ratio}: {what}"


def size_text(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 / 10 else _bytes(n)


def _bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 / 10 else f"{n / 2**10:.1f} KiB"
