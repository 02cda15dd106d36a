"""Tree-operation throughput on a request trace, through the public cache API.

    python benchmarks/tree_ops.py --trace FILE.npz --capacity 200000 --mode full|swa|mamba --json

Per request, the loop every peer in ../shared/peers/compare_tree_ops.py runs: match
(and lock), evict if short, allocate the rest, insert, unlock. Here that is
UnifiedRadixCache.match_prefix, alloc_request (evicts on shortfall) and cache_finished,
on accounting-only pools (the same allocators as with tensors, no memory behind them).
In mamba mode a request that matched deeper than its safe boundary also hands in a
checkpoint at its junction, as the engine does. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from uniradix.cache import UnifiedRadixCache
from uniradix.memory import HandleAllocator
from uniradix.tree import FullComponent, MambaComponent, RadixTree, SWAComponent

WINDOW = 4096
MAMBA_SLOTS = 512


def load_trace(path: str) -> list[list[int]]:
    data = np.load(path)
    tokens, offsets = data["tokens"], data["offsets"]
    return [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]


def build(mode: str, capacity: int, page_size: int, policy: str) -> UnifiedRadixCache:
    comps = [FullComponent()]
    pools = {"full": HandleAllocator(capacity // page_size, "full")}
    if mode == "swa":
        comps.append(SWAComponent(WINDOW))
        pools["swa"] = HandleAllocator(capacity // page_size, "swa")
    elif mode == "mamba":
        comps.append(MambaComponent())
        pools["mamba"] = HandleAllocator(MAMBA_SLOTS, "mamba")
    tree = RadixTree(comps, page_size=page_size, eviction_policy=policy)
    return UnifiedRadixCache(tree, pools, copy_checkpoints=False)


def run(trace: list[list[int]], mode: str, capacity: int, page_size: int = 1, policy: str = "lru") -> dict:
    cache = build(mode, capacity, page_size, policy)
    mamba = mode == "mamba"
    hit = tokens = 0
    t0 = time.perf_counter()
    for seq in trace:
        req = cache.match_prefix(seq)
        tokens += len(seq)
        hit += req.prefix_len
        if mamba and req.matched > req.prefix_len:
            cache.add_checkpoint(req, req.matched - req.matched % page_size)
        cache.alloc_request(req)
        req.state_len = req.num_tokens  # the engine's prefill ran to the end
        cache.cache_finished(req)
    seconds = time.perf_counter() - t0
    st = cache.stats()
    return {
        "impl": f"uniradix-{mode}", "requests": len(trace), "tokens": tokens,
        "hit_rate": round(hit / tokens, 4),
        "evicted_tokens": st["components"]["full"]["evicted"] * page_size,
        "req_per_s": round(len(trace) / seconds, 1), "seconds": round(seconds, 3),
        "nodes": st["nodes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, help=".npz trace (../shared/peers/trace.py format)")
    ap.add_argument("--capacity", type=int, default=200_000, help="FULL (and SWA) pool size in tokens")
    ap.add_argument("--mode", choices=("full", "swa", "mamba"), default="full")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--radix-eviction-policy", default="lru")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    a = ap.parse_args()
    if not os.path.exists(a.trace):
        sys.exit(f"no trace at {a.trace}; make one with ../shared/peers/trace.py OUT.npz N")
    r = run(load_trace(a.trace), a.mode, a.capacity, a.page_size, a.radix_eviction_policy)
    if not a.json:
        for k, v in r.items():
            print(f"{k:16s} {v}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
