"""Tree-operation throughput on a request trace, through the public cache API.

    python benchmarks/tree_ops.py --trace FILE.npz --capacity 200000 --mode full|swa|mamba --json

Per request, the loop every peer in benchmarks/peers/compare_tree_ops.py runs: match
(and lock), evict if short, allocate the rest, insert, unlock. Here that is
UnifiedRadixCache.match_prefix(alloc=True) (match, lock, evict on shortfall, allocate)
and cache_finished (insert, free what the tree did not keep, unlock), on
accounting-only pools (the same allocators as with tensors, no memory behind them).
In mamba mode a request that matched deeper than its safe boundary also hands in a
checkpoint at its junction, as the engine does. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
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


def synthetic_trace(n: int, seed: int = 0, vocab: int = 50_000) -> list[list[int]]:
    """Chat-like traffic: shared system prompts of skewed popularity, and conversations
    that come back for another turn (the whole history plus a new message), so the
    cache sees both wide sharing and deep reuse. Each entry is the full sequence a
    request leaves behind (prompt plus its answer)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(256, 1024))] for _ in range(48)]
    popularity = [1.0 / (k + 1) for k in range(len(systems))]
    live: list[list[int]] = []
    out = []
    for _ in range(n):
        turn = [rng.randrange(vocab) for _ in range(rng.randint(24, 320))]
        if live and rng.random() < 0.4:
            k = len(live) - 1 - min(int(rng.expovariate(1 / 64)), len(live) - 1)
            history = live.pop(k)
        else:
            history = list(rng.choices(systems, popularity)[0])
        prompt = (history + turn)[-6000:]
        full = prompt + [rng.randrange(vocab) for _ in range(rng.randint(16, 160))]
        out.append(full)
        live.append(full)
        if len(live) > 1000:
            live.pop(0)
    return out


def build(mode: str, capacity: int, page_size: int, policy: str, drafts: bool = False) -> UnifiedRadixCache:
    comps = [FullComponent()]
    pools = {"full": HandleAllocator(capacity // page_size, "full")}
    if mode == "swa":
        comps.append(SWAComponent(WINDOW))
        pools["swa"] = HandleAllocator(capacity // page_size, "swa")
    elif mode == "mamba":
        comps.append(MambaComponent())
        pools["mamba"] = HandleAllocator(MAMBA_SLOTS, "mamba")
    tree = RadixTree(comps, page_size=page_size, eviction_policy=policy)
    if drafts:  # what speculation's SUFFIX drafts cost the tree: its index of the spans, kept in step
        from uniradix.tree.drafts import DraftIndex
        tree.drafts = DraftIndex()
    return UnifiedRadixCache(tree, pools, copy_checkpoints=False)


def run(trace: list[list[int]], mode: str, capacity: int, page_size: int = 1, policy: str = "lru",
        drafts: bool = False) -> dict:
    cache = build(mode, capacity, page_size, policy, drafts)
    mamba = mode == "mamba"
    hit = tokens = 0
    t0 = time.perf_counter()
    for seq in trace:
        req = cache.match_prefix(seq, alloc=True)
        tokens += len(seq)
        hit += req.prefix_len
        if mamba and req.junction > req.prefix_len:
            cache.add_checkpoint(req, req.junction - req.junction % page_size)
        req.computed = req.allocated  # the engine's prefill ran to the end
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
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help=".npz trace (benchmarks/peers/trace.py format: tokens, offsets)")
    src.add_argument("--synthetic", type=int, metavar="N", help="generate a chat-like trace of N requests")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated trace")
    ap.add_argument("--capacity", type=int, default=200_000, help="FULL (and SWA) pool size in tokens")
    ap.add_argument("--mode", choices=("full", "swa", "mamba"), default="full")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--radix-eviction-policy", default="lru")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--draft-index", action="store_true",
                    help="keep speculation's draft index over the spans (what --speculative-algorithm SUFFIX costs)")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the loaded trace in the cyclic GC's view (slower, as the peers' harness does)")
    a = ap.parse_args()
    if a.trace is not None:
        if not os.path.exists(a.trace):
            sys.exit(f"no trace at {a.trace}; make one with benchmarks/peers/trace.py OUT.npz N")
        trace = load_trace(a.trace)
    else:
        trace = synthetic_trace(a.synthetic, a.seed)
    if not a.no_gc_freeze:
        # The input (millions of token ints in lists) would otherwise be rescanned by
        # every full collection; the cache's own objects are collected as usual.
        gc.freeze()
    r = run(trace, a.mode, a.capacity, a.page_size, a.radix_eviction_policy, a.draft_index)
    if not a.json:
        for k, v in r.items():
            print(f"{k:16s} {v}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
