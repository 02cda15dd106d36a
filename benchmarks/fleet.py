"""Several servers, one cache: `--workers` uniradix servers behind SGLang's gateway
(smg), with no L3 and over one shared Redis L3, under three routing policies, in one
run; then the same fleet with a worker SIGKILLed in the middle and restarted.

    pip install -e ".[test,plots]"   # smg (the gateway) is a test dependency
    apt-get install redis-server
    python benchmarks/fleet.py [--workers 3 --clients 24 --rounds 6] [--plot docs/fleet.png]

Workload: `uniradix bench multiturn` (bench/http_multiturn.py) through the gateway,
`--clients` conversations with session ids, each opening with a document of its own
and adding a turn a round, replies streamed, at most `--max-parallel` in flight. There
are enough conversations that one worker's device and host tiers cannot hold all of
them (the start line says how many tokens they reach against one worker's tiers).

Policies: round_robin (the gateway spreads every request), cache_aware (it routes by
the prefixes it saw go to each worker) and session affinity (consistent_hashing on each
conversation's routing key, `X-SMG-Routing-Key`: a conversation stays on one worker).
Each with no L3 and with a shared Redis (emptied between configurations; workers and
gateway started afresh for each). Per configuration, per round and overall: the fleet's
hit rate (cached prefix tokens over prompt tokens, summed over every request), split by
the tier the cached tokens came from (device, host, L3; of L3's, those another instance
wrote), mean and p90 TTFT, effective input throughput (prompt tokens, cached ones
included, per second of the round).

`--kill` (on by default): the affinity fleet over the shared L3 and without L3, with
worker 2 SIGKILLed `--kill-after` seconds into round `--kill-round` (requests in flight
on it fail at the client: the gateway does not retry a stream), then restarted on its
port before round `--kill-round + 2`: the rounds after the kill against the same
configuration's rounds without it, and what the restarted worker read that the others
wrote.

Timings on this 2-core machine with every process on it are relative, not absolute:
hit rates do not depend on timing much, TTFTs do. Ends with one JSON line."""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "server"))   # the tests' process helpers: ServerProc, GatewayProc
sys.path.insert(0, str(ROOT / "tests" / "hicache"))  # redis_server

from gateway_proc import GatewayProc, free_port  # noqa: E402
from server_proc import ServerProc  # noqa: E402

from uniradix.bench import http_multiturn  # noqa: E402

#: (label, gateway policy, send routing keys)
POLICIES = (("round robin", "round_robin", False), ("cache-aware", "cache_aware", False),
            ("session affinity", "consistent_hashing", True))
TIERS = http_multiturn.TIERS
#: the gateway notices a dead worker within seconds (its defaults take minutes); its
#: overload protection is off: these workers' device pools are small on purpose (the
#: working set must outgrow them), so while requests run their token usage sits above
#: smg's 0.8, and the protection vetoed both survivors of a kill at once (a first run:
#: 10 requests answered 503 no_available_workers in the second after it)
GATEWAY_FLAGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                 "--disable-worker-overload-protection")


def worker_flags(a, store_url: str | None) -> list[str]:
    flags = ["--max-total-tokens", str(a.max_total_tokens), "--max-running-requests", str(a.max_running_requests),
             "--enable-hierarchical-cache", "--hicache-ratio", str(a.hicache_ratio), "--session-timeout", "600"]
    if store_url:
        extra = {"url": store_url, "prefetch_threshold": a.prefetch_threshold}
        flags += ["--hicache-storage-backend", "redis", "--hicache-storage-backend-extra-config", json.dumps(extra),
                  "--hicache-storage-prefetch-policy", "wait_complete"]
    return flags


def start_workers(a, store_url) -> list[ServerProc]:
    """The workers, started side by side (one compute thread each: ServerProc's)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(a.workers) as pool:
        return list(pool.map(lambda p: ServerProc(*worker_flags(a, store_url), "--port", str(p)),
                             [free_port() for _ in range(a.workers)]))


def workload(a, url: str, routing_key: bool, seed: int) -> argparse.Namespace:
    return argparse.Namespace(url=url, api="sglang", model="default", api_key=None, clients=a.clients,
                              rounds=a.rounds, preamble_words=a.preamble_words, document_words=a.document_words,
                              new_words=a.new_words, output_tokens=a.output_tokens, max_parallel=a.max_parallel,
                              request_rate=0.0, session_id=True, routing_key=routing_key, seed=seed,
                              timeout=600.0, log=None, plot=None, no_progress=True)


def run_config(a, label: str, policy: str, routing_key: bool, redis, kill: bool = False) -> dict:
    """One fleet, started afresh: the workload through the gateway; with `kill`, worker
    2 is SIGKILLed mid-run and restarted two rounds later."""
    if redis is not None:
        redis.cli("FLUSHALL")
    store = redis.url if redis is not None else None
    workers = start_workers(a, store)
    gw = GatewayProc([f"http://127.0.0.1:{w.port}" for w in workers], policy, *GATEWAY_FLAGS)
    events: dict = {}
    now = {"round": 0}
    shooter: list[threading.Thread] = []

    def shoot() -> None:
        """SIGKILL worker 2 once it has requests running (--kill-after seconds into the
        kill round at the earliest), so that some fail in flight; the round it happened
        in is recorded as it was."""
        victim, t0 = workers[1], time.monotonic()
        time.sleep(a.kill_after)
        while time.monotonic() - t0 < 120:
            try:
                if victim.metrics()["uniradix_running_requests"] > 0:
                    break
            except (OSError, AssertionError):
                break
            time.sleep(0.02)
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        events["killed"] = {"round": now["round"], "port": victim.port, "at_s": round(time.monotonic() - t0, 2)}

    def before_round(rnd: int) -> None:
        now["round"] = rnd
        if kill and rnd == a.kill_round:
            shooter.append(threading.Thread(target=shoot, daemon=True))
            shooter[0].start()
        if kill and rnd == a.kill_round + 2:
            shooter[0].join()   # the restart comes after the kill, whenever it landed
            port = workers[1].port
            workers[1] = ServerProc(*worker_flags(a, store), "--port", str(port))
            deadline = time.monotonic() + 60   # the gateway's health checks let it back in
            while time.monotonic() < deadline:
                if all(w["is_healthy"] for w in gw.workers()):
                    break
                time.sleep(0.5)
            events["restarted"] = {"round": rnd, "port": port}

    t0 = time.perf_counter()
    try:
        with open(os.devnull, "w") as quiet:   # the table is printed at the end, for every configuration
            rows = http_multiturn.run(workload(a, f"http://127.0.0.1:{gw.port}", routing_key, a.seed), quiet,
                                      before_round)
        metrics = [w.metrics() if w.proc.poll() is None else {} for w in workers]
    finally:
        gw.stop()
        for w in workers:
            if w.proc.poll() is None:
                w.stop()
    out = {"label": label, "policy": policy, "l3": redis is not None, "kill": kill, "rounds": rows,
           "wall_s": time.perf_counter() - t0, **events}
    if kill and "restarted" in events:
        m = metrics[1]   # the restarted worker: what it served, and what of it the others wrote
        out["restarted_worker"] = {"prompt_tokens": m.get("uniradix_prompt_tokens_total", 0),
                                   "cached_storage": m.get('uniradix_cached_tokens_total{tier="storage"}', 0),
                                   "cross_instance": m.get("uniradix_cached_tokens_cross_instance_total", 0),
                                   "instances_seen": m.get("uniradix_storage_instances_seen", 0)}
    return out


def totals(rows: list[dict]) -> dict:
    """The rounds summed: hit rate and tier shares over prompt tokens; TTFT as the
    rounds' requests weighted mean (p90: the worst round's)."""
    p = sum(r["prompt_tokens"] for r in rows)
    c = sum(r["cached_tokens"] or 0 for r in rows)
    by = {t: sum((r["cached_by_tier"] or {}).get(t, 0) for r in rows) for t in TIERS}
    served = [r for r in rows if r["ttft_mean"] is not None]
    n = sum(r["requests"] - r["errors"] for r in served)
    ttft = sum(r["ttft_mean"] * (r["requests"] - r["errors"]) for r in served) / n if n else None
    return {"prompt_tokens": p, "hit_rate": c / p if p else None,
            **{f"{t}_share": by[t] / p if p else None for t in TIERS},
            "ttft_mean": ttft, "ttft_p90_worst": max((r["ttft_p90"] or 0 for r in rows), default=None),
            "input_tok_s": statistics.fmean([r["input_tok_s"] for r in rows if r["input_tok_s"]]) if rows else None,
            "errors": sum(r["errors"] for r in rows),
            "by_worker": sorted((sum((r.get("by_worker") or {}).get(w, 0) for r in rows)
                                 for w in {w for r in rows for w in (r.get("by_worker") or {})}), reverse=True)}


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_table(results: list[dict]) -> None:
    print(f"\n{'configuration':<34}{'hit rate':>9}{'device':>8}{'host':>8}{'L3':>8}{'(other)':>9}"
          f"{'TTFT ms':>9}{'p90 ms':>8}{'in tok/s':>9}{'errors':>7}  requests per worker")
    for r in results:
        t = totals(r["rounds"])
        name = f"{r['label']}, {'Redis L3' if r['l3'] else 'no L3'}" + (", kill" if r["kill"] else "")
        print(f"{name:<34}{pct(t['hit_rate']):>9}{pct(t['device_share']):>8}{pct(t['host_share']):>8}"
              f"{pct(t['storage_share']):>8}{pct(t['cross_instance_share']):>9}"
              f"{(t['ttft_mean'] or 0) * 1e3:>9.0f}{(t['ttft_p90_worst'] or 0) * 1e3:>8.0f}"
              f"{t['input_tok_s'] or 0:>9,.0f}{t['errors']:>7}  {'/'.join(map(str, t['by_worker']))}")
    print("\nhit rate by round (fleet: cached / prompt tokens summed over every request of the round)")
    rounds = len(results[0]["rounds"])
    print(f"{'configuration':<34}" + "".join(f"{i:>7}" for i in range(1, rounds + 1)))
    for r in results:
        name = f"{r['label']}, {'Redis L3' if r['l3'] else 'no L3'}" + (", kill" if r["kill"] else "")
        print(f"{name:<34}" + "".join(f"{pct(x['hit_rate']):>7}" for x in r["rounds"]))


def print_kill(results: list[dict], a) -> None:
    for r in [x for x in results if x["kill"]]:
        base = next(x for x in results if not x["kill"] and x["policy"] == r["policy"] and x["l3"] == r["l3"])
        killed = r.get("killed") or {}
        k = killed.get("round", a.kill_round)   # the round it landed in
        after, before = totals(r["rounds"][k - 1:]), totals(base["rounds"][k - 1:])
        kill_round = r["rounds"][k - 1]
        print(f"\n{r['label']}, {'Redis L3' if r['l3'] else 'no L3'}: worker 2 SIGKILLed {killed.get('at_s', '?')} s "
              f"after round {a.kill_round} began, in round {k}, with requests running on it: "
              f"{kill_round['errors']} of {kill_round['requests']} requests of that round failed at the client "
              f"({(kill_round['first_error'] or '-')[:90]}); errors by round {[x['errors'] for x in r['rounds']]}")
        print(f"  rounds {k}-{a.rounds}: hit rate {pct(after['hit_rate'])} (L3 {pct(after['storage_share'])}, "
              f"of which another instance wrote {pct(after['cross_instance_share'])}) against "
              f"{pct(before['hit_rate'])} without the kill; errors {after['errors']} against {before['errors']}")
        rw = r.get("restarted_worker")
        if rw:
            print(f"  restarted before round {r['restarted']['round']}: it served {rw['prompt_tokens']:.0f} prompt "
                  f"tokens, {rw['cached_storage']:.0f} from L3, {rw['cross_instance']:.0f} of them written by another "
                  f"instance (the others, or itself before the kill: a restart is a new instance); it sees "
                  f"{rw['instances_seen']:.0f} other instances")


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'uniradix[plots]')")
        return
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in results:
        name = f"{r['label']}, {'L3' if r['l3'] else 'no L3'}" + (", kill" if r["kill"] else "")
        xs = [x["round"] for x in r["rounds"]]
        ax1.plot(xs, [100 * (x["hit_rate"] or 0) for x in r["rounds"]], marker="o",
                 linestyle="--" if r["kill"] else "-", label=name)
    ax1.set(xlabel="round", ylabel="fleet hit rate (%)", ylim=(0, 100), title="hit rate per round")
    ax1.legend(fontsize=7)
    base = [r for r in results if not r["kill"]]
    short = {"round robin": "round\nrobin", "cache-aware": "cache-\naware", "session affinity": "session\naffinity"}
    names = [f"{short.get(r['label'], r['label'])}\n{'Redis L3' if r['l3'] else 'no L3'}" for r in base]
    bottom = [0.0] * len(base)
    for tier, color in (("device", "#2f6fdf"), ("host", "#e38a1c"), ("own L3", "#2aa876"), ("other's L3", "#7fd1a9")):
        vals = []
        for r in base:
            t = totals(r["rounds"])
            v = {"device": t["device_share"], "host": t["host_share"],
                 "own L3": (t["storage_share"] or 0) - (t["cross_instance_share"] or 0),
                 "other's L3": t["cross_instance_share"]}[tier]
            vals.append(100 * (v or 0))
        ax2.bar(names, vals, bottom=bottom, color=color, label=tier)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set(ylabel="% of prompt tokens", ylim=(0, 100), title="where the cached tokens came from")
    ax2.tick_params(axis="x", labelsize=7)
    ax2.legend(fontsize=7, loc="upper left", ncol=4)
    ax3.bar(names, [1e3 * (totals(r["rounds"])["ttft_mean"] or 0) for r in base], color="#687085")
    ax3.set(ylabel="ms", title="mean TTFT")
    ax3.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--preamble-words", type=int, default=60)
    p.add_argument("--document-words", type=int, default=120)
    p.add_argument("--new-words", type=int, default=20)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--max-parallel", type=int, default=6)
    p.add_argument("--max-total-tokens", type=int, default=4096, help="each worker's device pool (tokens)")
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="each worker's host pool, times its device's")
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--prefetch-threshold", type=int, default=64)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kill-round", type=int, default=3)
    p.add_argument("--kill-after", type=float, default=1.0, help="seconds into the kill round")
    p.add_argument("--plot", default=None)
    a = p.parse_args()
    from redis_server import redis_server
    per_worker = a.max_total_tokens * (1 + a.hicache_ratio)
    words = a.preamble_words + a.document_words + a.rounds * a.new_words
    print(f"fleet: {a.workers} workers (device {a.max_total_tokens:,} + host {per_worker - a.max_total_tokens:,.0f} "
          f"tokens each) behind smg, {a.clients} conversations x {a.rounds} rounds of about {words} words "
          f"(~{words * 7:,} byte tokens each at the end, ~{a.clients * words * 7 / a.workers:,.0f} per worker "
          f"when spread evenly), {time.strftime('%Y-%m-%d')}", flush=True)
    results = []
    with redis_server() as redis:
        for label, policy, key in POLICIES:
            for store in (None, redis):
                r = run_config(a, label, policy, key, store)
                t = totals(r["rounds"])
                print(f"  {label}, {'Redis L3' if store else 'no L3'}: hit rate {pct(t['hit_rate'])}, "
                      f"{r['wall_s']:.0f} s", flush=True)
                results.append(r)
        if a.kill:
            label, policy, key = POLICIES[2]
            for store in (redis, None):
                r = run_config(a, label, policy, key, store, kill=True)
                print(f"  {label}, {'Redis L3' if store else 'no L3'}, kill: hit rate "
                      f"{pct(totals(r['rounds'])['hit_rate'])}", flush=True)
                results.append(r)
    print_table(results)
    if a.kill:
        print_kill(results, a)
    if a.plot:
        plot(results, a.plot)
    print(json.dumps({"results": [{**{k: v for k, v in r.items() if k != "rounds"}, "totals": totals(r["rounds"]),
                                   "rounds": r["rounds"]} for r in results]}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
