"""The cliff: many clients, each extending one conversation for many rounds, on the
reference engine, with the device cache alone, with the host tier under it, and with
shared storage under both, in one run. The working set outgrows the device pools at
once and the host pools mid-run; from then on each tier above serves almost nothing,
and storage keeps the hit rate up. The tiers' loads are measured against raw copies
of the same bytes in the same run.

    pip install -e ".[plots]"   # matplotlib, for the PNG
    python benchmarks/multiturn_tiers.py [--clients 16 --rounds 12 --max-total-tokens 4096]
    # a real checkpoint over Redis and over Mooncake (each started here, on 127.0.0.1),
    # pinned to one core with one torch thread:
    taskset -c 0 python benchmarks/multiturn_tiers.py --model-path gemma-3-270m-q4_k_m.gguf \
        --dtype bfloat16 --quantization none --storage redis --clients 8 --rounds 8 \
        --first-round-tokens 256 --tokens-per-round 64 --output-tokens 4 \
        --max-total-tokens 2304 --hicache-ratio 2 --repeats 1 --threads 1
    taskset -c 0 python benchmarks/multiturn_tiers.py --model-path gemma-3-270m-q4_k_m.gguf \
        --dtype bfloat16 --quantization none --storage mooncake ... (the same)

The model: --model-preset (the embedded tiny model, the default) or --model-path (a
GGUF file or a checkpoint directory, read as benchmarks/decode_step.py reads it:
uniradix.model.hf.load_checkpoint at --dtype, with --quantization; loaded once for
the whole run). --threads sets torch's threads (default: torch's own).

Each client opens with a document of its own (--first-round-tokens) and then adds a
short turn per round. Prints per round the hit rate (cached prefix tokens / prompt
tokens, summed over the round; host and storage hits count) and effective input
throughput (prompt tokens per second of the round, cached ones included) per
configuration, writes a PNG of both (--plot; skipped, with how to install matplotlib,
when it is missing), and ends with one JSON line.
Configurations: L1 (device pools only), L1+L2 (host pools --hicache-ratio times the
device's, write-through) and L1+L2+L3 (plus the --storage backend: file, in a fresh
temporary directory for each pass; redis, a redis-server this run starts and stops by
its PID, flushed before each pass; mooncake, a mooncake_master this run starts and
stops by its PID, with a client of the run lending --mooncake-segment-size of memory
for the objects and each pass under a prefix of its own, cleared before and after it;
see tiers_services.py). Nothing listens beyond 127.0.0.1.

Loads against raw (tiers_raw.py), from the counters the engine keeps:
- L2 (host -> device, cache.stats()["host"]): the bytes the layer-by-layer loads of
  host hits copied (load_bytes) over the copy thread's wall time from its first copy
  to its last (load_copy_s; its CPU time beside it), against a torch memcpy of blocks
  the size of the mean load, as many bytes, right after the pass. The overlap: the
  seconds the scheduler's thread waited for loads (load_wait_s: the forward's
  wait_layer, and the syncs after it) against the copies' wall seconds; the rest was
  hidden under other work. On one core (taskset, --threads 1) the copy thread and the
  forward share the core: hidden there means the forward did not wait, not that the
  copy cost nothing. Under L1+L2+L3, L3 data also travels host -> device
  (staged_load_*), reported apart.
- L3 (store -> host, the storage tier's stats()["storage"]): the bytes the loads' reads
  returned (get_bytes, headers included) over the seconds of the backend's batch_get
  (get_s), over the whole read with the objects' checks (fetch_s), and through to the
  host pools (plus staged_write_s), against raw reads of values of the mean object
  size, in batches of the mean objects per read, straight from the store's client:
  redis-py GET pipelines, the Mooncake client's get_batch, or reading files.

Timings on a shared machine drift, so the configurations are interleaved rather than
run one after another: each of the --repeats passes runs every configuration once,
starting with a different one each pass, and the tables give the median throughput and
TTFT over the passes (the ratios against L1 are ratios of those medians). Hit rates do
not depend on timing: the run says whether they were identical in every pass. The
load bandwidths are over all passes (bytes and seconds summed), the raw ones the
median of each pass's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tiers_services, tiers_raw (run_path too)

import tiers_raw  # noqa: E402
import tiers_services  # noqa: E402
from uniradix.bench import MultiTurnWorkload, run_multiturn  # noqa: E402
from uniradix.config import EngineConfig  # noqa: E402
from uniradix.engine import Engine  # noqa: E402

CONFIGS = ("L1", "L1+L2", "L1+L2+L3")
MB = 1e6


def load_model(a):
    """The preset's name (the engine builds it), or the checkpoint, loaded once."""
    if not a.model_path:
        return a.model_preset
    import torch

    from uniradix.model.hf import load_checkpoint
    return load_checkpoint(a.model_path, getattr(torch, a.dtype), a.quantization)


def run(config: str, wl: MultiTurnWorkload, a, model, store, prefix: str) -> tuple[list, dict]:
    settings = dict(page_size=a.page_size, max_total_tokens=a.max_total_tokens,
                    max_running_requests=a.max_running_requests, prefetch_threshold=a.prefetch_threshold,
                    hicache_storage_prefetch_policy="wait_complete",
                    enable_hierarchical_cache="L2" in config, hicache_ratio=a.hicache_ratio)
    l3 = "L3" in config
    if l3:  # the one builder of a backend (hicache.backends.open_backend), on a store emptied for this pass
        settings.update(hicache_storage_backend=a.storage,
                        hicache_storage_backend_extra_config=json.dumps(store.fresh(prefix)))
    # a tier this configuration leaves out takes none of its settings (an Engine refuses them)
    eng = Engine(model, **EngineConfig.only_in_effect(settings, store=l3))
    try:
        rounds = run_multiturn(eng, wl)
        return rounds, eng.stats()
    finally:
        eng.close()


def raw_baselines(config: str, st: dict, a, store, prefix: str) -> dict:
    """This pass's raw baselines for the loads it made (bytes per second; None: none)."""
    out = {}
    host = st["cache"].get("host")
    if host and host["load_bytes"] and host["loads"]:
        out["l2_memcpy_bps"] = tiers_raw.memcpy_bps(max(1, host["load_bytes"] // host["loads"]), host["load_bytes"])
        out["l2_memcpy_block_bytes"] = host["load_bytes"] // host["loads"]
    sc = st.get("storage") or {}
    if "L3" in config and sc.get("get_objects"):
        size = sc["get_bytes"] / sc["get_objects"]
        batch = sc["get_objects"] / sc["get_calls"]
        count = sc["get_objects"]
        if a.storage == "redis":
            out["l3_raw_bps"] = tiers_raw.redis_get_bps(store.url, size, batch, count)
        elif a.storage == "mooncake":
            out["l3_raw_bps"] = tiers_raw.mooncake_get_bps(store.client_config("raw-baseline:"), size, batch, count)
        else:
            out["l3_raw_bps"] = tiers_raw.file_read_bps(store.dir, size, batch, count)
        out.update(l3_raw_value_bytes=int(size), l3_raw_batch=round(batch))
    return out


def plot(rounds: dict, path: str, title: str) -> None:
    """`rounds`: per configuration, the per-round medians (`median_rounds`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for cfg, rs in rounds.items():
        xs = [r["round"] for r in rs]
        ax1.plot(xs, [100 * r["hit_rate"] if r["hit_rate"] is not None else None for r in rs],
                 marker="o", label=cfg)
        ax2.plot(xs, [r["input_throughput"] for r in rs], marker="o", label=cfg)
    ax1.set(xlabel="round", ylabel="hit rate (%)", ylim=(0, 100), title="cached / prompt tokens per round")
    ax2.set(xlabel="round", ylabel="input tokens / s", title="effective input throughput (median)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def median(values):
    """Median of the figures there are (a round that served nothing has none); None if none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def median_rounds(passes: list[list]) -> list[dict]:
    """Per round, over the passes: the hit rate (the first pass's; they should agree) and
    the medians of input throughput and mean TTFT."""
    return [dict(round=rs[0].round, hit_rate=rs[0].hit_rate,
                 input_throughput=median(r.input_throughput for r in rs),
                 ttft_mean_s=median(r.ttft_mean for r in rs))
            for rs in zip(*passes)]


def last_quarter(rounds: list, q: int) -> dict:
    """One pass's last `q` rounds, summed over the rounds (not averaged per round)."""
    last = rounds[-q:]
    prompt = sum(r.prompt_tokens for r in last)
    wall = sum(r.wall_s for r in last)
    ttfts = [t for r in last for t in r.ttfts]
    return dict(hit_rate=sum(r.cached_tokens for r in last) / prompt if prompt else None,
                input_throughput=prompt / wall if prompt and wall > 0 else None,
                ttft_mean_ms=1e3 * statistics.fmean(ttfts) if ttfts else None)


def hit_rate_differences(passes: list[list]) -> list[str]:
    """Rounds whose cached and prompt tokens were not the same in every pass."""
    return [f"round {rs[0].round}: " + ", ".join(fmt(r.hit_rate, ".1%", 0) for r in rs)
            for rs in zip(*passes)
            if len({(r.cached_tokens, r.prompt_tokens) for r in rs}) > 1]


def parse_size(text: str) -> int:
    """Bytes from "2GB", "512MiB", "1048576" (powers of 1024, as Mooncake's sizes)."""
    from uniradix.hicache.backends.mooncake import parse_size as mooncake_size
    return mooncake_size(text, "--mooncake-segment-size")


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9 if nbytes and seconds and seconds > 0 else None


def pct(x, base):
    return f"{100 * x / base:.0f}%" if x is not None and base else "-"


def bandwidth(c: str, st: list[dict], raws: list[dict], a) -> tuple[dict, list[str]]:
    """The loads of configuration `c` over all passes against their raw baselines: the
    figures (JSON) and the lines to print."""
    out, lines = {}, []
    hosts = [s["cache"]["host"] for s in st if s["cache"].get("host")]
    if hosts:
        tot = {k: sum(h[k] for h in hosts) for k in ("loads", "load_bytes", "load_copy_s", "load_copy_cpu_s",
                                                     "staged_load_bytes", "staged_load_copy_s",
                                                     "staged_load_copy_cpu_s", "load_wait_s")}
        raw = median(r.get("l2_memcpy_bps") for r in raws)
        raw_g = raw / 1e9 if raw else None
        wall, cpu = gbps(tot["load_bytes"], tot["load_copy_s"]), gbps(tot["load_bytes"], tot["load_copy_cpu_s"])
        out["l2"] = dict(tot, load_gbps=wall, load_gbps_cpu=cpu, raw_memcpy_gbps=raw_g)
        if tot["load_bytes"]:
            block = median(r.get("l2_memcpy_block_bytes") for r in raws)
            lines.append(f"L2 -> L1 (host -> device), {c}: loaded {tot['load_bytes'] / MB:,.1f} MB of host hits in "
                         f"{tot['loads']} loads at {fmt(wall, '.2f', 0)} GB/s = {pct(wall, raw_g)} of raw "
                         f"(over the copy thread's wall time, {tot['load_copy_s']:.3f} s; over its CPU time "
                         f"{fmt(cpu, '.2f', 0)} GB/s = {pct(cpu, raw_g)}; raw: torch memcpy of "
                         f"{(block or 0) / MB:.2f}-MB blocks, {fmt(raw_g, '.2f', 0)} GB/s)")
        else:
            lines.append(f"L2 -> L1 (host -> device), {c}: nothing loaded from the host tier")
        if tot["staged_load_bytes"]:
            sw, sc = (gbps(tot["staged_load_bytes"], tot[k]) for k in ("staged_load_copy_s", "staged_load_copy_cpu_s"))
            lines.append(f"L3 data host -> device, {c}: {tot['staged_load_bytes'] / MB:,.1f} MB at {fmt(sw, '.2f', 0)} "
                         f"GB/s = {pct(sw, raw_g)} of raw (CPU time: {fmt(sc, '.2f', 0)} GB/s)")
        copies = tot["load_copy_s"] + tot["staged_load_copy_s"]
        if copies > 0:
            hidden = max(0.0, 1 - tot["load_wait_s"] / copies)
            out["l2"]["hidden_fraction"] = hidden
            one_core = (" (one torch thread: the copy thread shares the CPU with the forward, so hidden means the "
                        "forward did not wait, not that the copy was free)") if a.threads == 1 else ""
            lines.append(f"L2 layer-by-layer overlap, {c}: the scheduler waited {tot['load_wait_s']:.3f} s for loads "
                         f"whose copies took {copies:.3f} s: {100 * hidden:.0f}% hidden{one_core}")
    stores = [s["storage"] for s in st if s.get("storage")]
    if "L3" in c and stores:
        tot = {k: sum(x[k] for x in stores) for k in ("get_calls", "get_objects", "get_bytes", "get_s", "fetch_s")}
        landing = sum(s["cache"]["host"]["staged_write_s"] for s in st if s["cache"].get("host"))
        raw = median(r.get("l3_raw_bps") for r in raws)
        raw_g = raw / 1e9 if raw else None
        get, fetch = gbps(tot["get_bytes"], tot["get_s"]), gbps(tot["get_bytes"], tot["fetch_s"])
        path = gbps(tot["get_bytes"], tot["fetch_s"] + landing)
        out["l3"] = dict(tot, staged_write_s=landing, get_gbps=get, fetch_gbps=fetch, to_host_gbps=path,
                         raw_gbps=raw_g, backend=a.storage)
        if tot["get_bytes"]:
            size = median(r.get("l3_raw_value_bytes") for r in raws) or 0
            batch = median(r.get("l3_raw_batch") for r in raws) or 0
            how = {"redis": "redis-py GET pipelines", "mooncake": "the Mooncake client's get_batch",
                   "file": "reading files"}[a.storage]
            lines.append(f"L3 -> L2 (store -> host), {c}, {a.storage}: loaded {tot['get_bytes'] / MB:,.1f} MB in "
                         f"{tot['get_calls']} reads at {fmt(path, '.2f', 0)} GB/s = {pct(path, raw_g)} of raw "
                         f"(read, checked and landed in the host pools, {tot['fetch_s'] + landing:.3f} s; the "
                         f"backend's batch_get alone {fmt(get, '.2f', 0)} GB/s = {pct(get, raw_g)}; with the "
                         f"objects' checks {fmt(fetch, '.2f', 0)} GB/s; raw: {how} of {size / 1e3:,.0f}-KB values, "
                         f"{batch:.0f} a read, {fmt(raw_g, '.2f', 0)} GB/s)")
        else:
            lines.append(f"L3 -> L2 (store -> host), {c}, {a.storage}: nothing read from the store")
        written = max(s["storage_written_bytes"] for s in st)
        out["l3"]["written_bytes_max_pass"] = written
        if a.storage == "mooncake" and written > 0.8 * parse_size(a.mooncake_segment_size):
            lines.append(f"WARNING: a pass wrote {written / MB:,.0f} MB to Mooncake, near the "
                         f"{a.mooncake_segment_size} lent (--mooncake-segment-size): the master may have evicted "
                         f"objects (misses that are not the cache's)")
    return out, lines


def main() -> None:
    import torch
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--first-round-tokens", type=int, default=768, help="each client's own document")
    p.add_argument("--tokens-per-round", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--shared-prefix-tokens", type=int, default=0)
    p.add_argument("--model-preset", default="tiny-hybrid", help="the embedded model (without --model-path)")
    p.add_argument("--model-path", default=None, help="a GGUF file or checkpoint directory instead of the preset")
    p.add_argument("--dtype", default="bfloat16", help="with --model-path: float32, bfloat16, float16")
    p.add_argument("--quantization", default="none", help="with --model-path: none, stored, int8, int4")
    p.add_argument("--storage", choices=("file", "redis", "mooncake"), default="file",
                   help="the L3 backend (redis and mooncake: a server started here on 127.0.0.1)")
    p.add_argument("--mooncake-segment-size", default="2GB",
                   help="memory the run's Mooncake client lends the store for the objects")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=4096, help="the device (L1) pools")
    p.add_argument("--hicache-ratio", type=float, default=4.0, help="the host (L2) pools, times L1")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--prefetch-threshold", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3,
                   help="passes over the configurations, interleaved; tables give medians")
    p.add_argument("--plot", default="multiturn_tiers.png", help="PNG path ('' for none)")
    a = p.parse_args()
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    if a.threads < 1:
        p.error(f"--threads must be at least 1, got {a.threads}")
    try:
        segment = parse_size(a.mooncake_segment_size)
    except ValueError as e:
        p.error(str(e))
    if a.storage == "redis" and tiers_services.redis_binary() is None:
        p.error("--storage redis: redis-server not found (apt-get install redis-server)")
    if a.storage == "mooncake" and (why := tiers_services.mooncake_missing()):
        p.error(f"--storage mooncake: {why}")
    torch.set_num_threads(a.threads)
    model = load_model(a)
    name = a.model_preset if not a.model_path else f"{os.path.basename(a.model_path.rstrip('/'))} ({a.dtype}, " \
                                                  f"quantization {a.quantization})"
    vocab = {} if isinstance(model, str) else {"vocab_size": min(model.vocab_size, 32000)}
    wl = MultiTurnWorkload(clients=a.clients, rounds=a.rounds, tokens_per_round=a.tokens_per_round,
                           output_tokens=a.output_tokens, shared_prefix_tokens=a.shared_prefix_tokens,
                           first_round_tokens=a.first_round_tokens, **vocab)
    first = a.clients * (a.shared_prefix_tokens + wl.first_tokens + a.output_tokens)
    final = a.clients * wl.final_context
    host = int(a.max_total_tokens * a.hicache_ratio)
    print(f"{name}, {wl.clients} clients x {wl.rounds} rounds: a {wl.first_tokens}-token document "
          f"each, then {wl.tokens_per_round} new and {wl.output_tokens} output tokens per round; "
          f"working set {first} tokens after round 1, {final} at the end; device pools (L1) "
          f"{a.max_total_tokens} tokens, host pools (L2) {host}; page size {a.page_size}; L3 {a.storage}; "
          f"{a.threads} torch thread(s); {a.repeats} interleaved passes, medians", flush=True)
    passes = {c: [] for c in CONFIGS}
    stats = {c: [] for c in CONFIGS}
    raws = {c: [] for c in CONFIGS}
    with tiers_services.running(a.storage, segment_size=segment) as store:
        if store.pid is not None:
            print(f"{a.storage}: started on 127.0.0.1 (PID {store.pid}); stopped by its PID at the end",
                  file=sys.stderr, flush=True)
        for k in range(a.repeats):
            # each pass starts with a different configuration: none always runs first
            for cfg in CONFIGS[k % len(CONFIGS):] + CONFIGS[:k % len(CONFIGS)]:
                print(f"pass {k + 1}/{a.repeats}: {cfg}", file=sys.stderr, flush=True)
                prefix = f"tiers-{k}:"
                try:
                    rounds, st = run(cfg, wl, a, model, store, prefix)
                    passes[cfg].append(rounds)
                    stats[cfg].append(st)
                    raws[cfg].append(raw_baselines(cfg, st, a, store, prefix))
                finally:
                    if "L3" in cfg:
                        store.done(prefix)
    names = list(CONFIGS)
    medians = {c: median_rounds(passes[c]) for c in names}
    print("round " + " ".join(f"{'hit ' + c:>12} {'tok/s ' + c:>14}" for c in names))
    for i in range(wl.rounds):
        print(f"{i + 1:>5} " + " ".join(f"{fmt(medians[c][i]['hit_rate'], '.1%', 12)} "
                                        f"{fmt(medians[c][i]['input_throughput'], ',.0f', 14)}"
                                        for c in names))
    differ = {c: hit_rate_differences(passes[c]) for c in names}
    if any(differ.values()):
        for c in names:
            for line in differ[c]:
                print(f"hit rates differ across passes, {c}, {line} (the table shows pass 1's)")
    else:
        print(f"hit rates identical in all {a.repeats} passes; tok/s and TTFT are medians over them")
    errors = {c: sum(r.errors for rs in passes[c] for r in rs) for c in names}
    if any(errors.values()):
        print(f"ERRORS (failed requests over all passes; their prompts count as uncached): {errors}")
    q = max(1, wl.rounds // 4)
    summary = {}
    for c in names:
        each = [last_quarter(rs, q) for rs in passes[c]]
        summary[c] = dict(
            hit_rate_last_quarter=median(e["hit_rate"] for e in each),
            input_throughput_last_quarter=median(e["input_throughput"] for e in each),
            ttft_mean_ms_last_quarter=median(e["ttft_mean_ms"] for e in each),
            input_throughput_last_quarter_each=[e["input_throughput"] for e in each],
            ttft_mean_ms_last_quarter_each=[e["ttft_mean_ms"] for e in each])
        spread = [v for v in summary[c]["input_throughput_last_quarter_each"] if v is not None]
        print(f"last {q} rounds, {c}: hit rate {fmt(summary[c]['hit_rate_last_quarter'], '.1%', 0)}, "
              f"{fmt(summary[c]['input_throughput_last_quarter'], ',.0f', 0)} input tok/s, "
              f"TTFT {fmt(summary[c]['ttft_mean_ms_last_quarter'], '.1f', 0)} ms"
              + (f" (medians; tok/s {min(spread):,.0f} to {max(spread):,.0f})" if len(spread) > 1 else ""))
    counts = ("cached_tokens", "prompt_tokens", "host_tokens", "storage_tokens", "preemptions", "errors")
    for c in names:
        s = stats[c][0]
        same = all(all(st[k] == s[k] for k in counts) for st in stats[c][1:])
        print(f"{c}: {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens cached, {s['host_tokens']} "
              f"loaded from L2 and {s['storage_tokens']} from L3; {s['preemptions']} preemptions, "
              f"{s['errors']} errors" + ("" if same else " (pass 1; other passes differ)"))
    base = summary["L1"]["input_throughput_last_quarter"]
    for c in names[1:]:
        mine = summary[c]["input_throughput_last_quarter"]
        ratio = mine / base if mine is not None and base else None
        each = [x / b if x is not None and b else None
                for x, b in zip(summary[c]["input_throughput_last_quarter_each"],
                                summary["L1"]["input_throughput_last_quarter_each"])]
        summary[c]["throughput_over_l1_last_quarter"] = ratio
        print(f"{c} / L1 input throughput, last {q} rounds: {fmt(ratio, '.2f', 0)}"
              + (f" (ratio of medians; per pass {', '.join(fmt(x, '.2f', 0) for x in each)})"
                 if a.repeats > 1 else ""))
    loads = {}
    for c in names:
        loads[c], lines = bandwidth(c, stats[c], raws[c], a)
        for line in lines:
            print(line)
    if a.plot:
        try:
            plot(medians, a.plot, f"{name}: {wl.clients} clients, device pools "
                                  f"{a.max_total_tokens} tokens, medians of {a.repeats}")
            print(f"plot: {a.plot}")
        except ImportError:  # the tables above are the result; the PNG is optional
            print('plot skipped: matplotlib is not installed (pip install -e ".[plots]" for the PNG, '
                  "or --plot '' for none)")
    print(json.dumps({"model": name, "storage": a.storage, "threads": a.threads, "repeats": a.repeats,
                      "summary": summary, "loads": loads, "rounds": medians,
                      "tokens": {c: [{k: st[k] for k in counts} for st in stats[c]] for c in names},
                      "passes": {c: [[r.as_dict() for r in rs] for rs in passes[c]] for c in names}}))


if __name__ == "__main__":
    main()
