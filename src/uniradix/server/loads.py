"""`GET /v1/loads`: the load report SGLang's servers give and SGLang's gateway (smg)
polls on every worker to route by load (power_of_two, least_load) and to leave out an
overloaded worker (its overload protection, on for every policy: at 8 waiting requests
or a token usage of 0.8). Its shape is SGLang's: counts are integers, and a figure
this server cannot give is left out rather than null (the gateway gives up on a report
it cannot parse, for good).

`token_usage` is the share of a pool that running requests and locked slots hold: the
cached slots that could be evicted are free to a new request, so a warm cache full of
reusable prefixes is not an overloaded worker. Of the components, the fullest one
counts: it is what admission runs out of first."""
from __future__ import annotations

import time
from datetime import datetime, timezone

#: seconds of history the decode throughput is measured over
THROUGHPUT_S = 10.0


def pool_use(stats: dict, structural: str) -> tuple[float, int, int]:
    """(token usage, used pages and pool pages of the `structural` component, the one
    whose pages are the tokens) from the cache's stats: used = the pool less what is
    free and what the tree could evict."""
    usage, used, size = 0.0, 0, 0
    for name, cs in stats["components"].items():
        total = cs.get("pool_size")
        if not total:
            continue
        held = max(0, total - cs["pool_available"] - cs["evictable"])
        usage = max(usage, held / total)
        if name == structural:
            used, size = held, total
    return usage, used, size


def decode_throughput(samples) -> float | None:
    """Decode tokens a second over the last THROUGHPUT_S seconds of the dashboard's
    history; None without two samples that far apart."""
    if len(samples) < 2:
        return None
    last = samples[-1]
    first = next((s for s in reversed(samples) if last["m"] - s["m"] >= THROUGHPUT_S), samples[0])
    dt = last["m"] - first["m"]
    return (last["decode"] - first["decode"]) / dt if dt > 0 else None


def scheduler_loads(engine, history, version: str) -> dict:
    """The report (the scheduler thread's: one moment of the engine)."""
    st = engine.stats()
    running, waiting = st["running"] + st["prefetching"], st["waiting"]
    usage, used, size = pool_use(st["cache"], engine.cache.tree.structural.name)
    P = engine.cache.page_size
    load = {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            # an upper bound: their prompts, before any is matched against the cache
            "num_waiting_uncached_tokens": sum(len(s.tokens) for s in engine.waiting),
            "num_total_reqs": running + waiting, "num_used_tokens": used * P,
            "max_total_num_tokens": size * P, "token_usage": round(usage, 6), "utilization": round(usage, 6),
            "cache_hit_rate": round(st["hit_rate"], 6), "max_running_requests": engine.max_running}
    rate = None if history is None else decode_throughput(history.samples)
    if rate:
        load["gen_throughput"] = round(rate, 3)
    aggregate = {"total_running_reqs": running, "total_waiting_reqs": waiting, "total_reqs": running + waiting,
                 "avg_token_usage": load["token_usage"], "avg_utilization": load["utilization"]}
    if rate:
        aggregate["avg_throughput"] = load["gen_throughput"]
    return {"timestamp": datetime.fromtimestamp(time.time(), timezone.utc).isoformat(), "version": version,
            "dp_rank_count": 1, "loads": [load], "aggregate": aggregate}
