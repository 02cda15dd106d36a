"""The cliff: many clients, each extending one conversation for many rounds, on the
reference engine, with the device cache alone, with the host tier under it, and with
shared storage under both, in one run. The working set outgrows the device pools at
once and the host pools mid-run; from then on each tier above serves almost nothing,
and storage keeps the hit rate up.

    pip install -e ".[plots]"   # matplotlib, for the PNG
    python benchmarks/multiturn_tiers.py [--clients 16 --rounds 12 --max-total-tokens 4096]

Each client opens with a document of its own (--first-round-tokens) and then adds a
short turn per round. Prints per round the hit rate (cached prefix tokens / prompt
tokens, summed over the round; host and storage hits count) and effective input
throughput (prompt tokens per second of the round, cached ones included) per
configuration, writes a PNG of both (--plot), and ends with one JSON line.
Configurations: L1 (device pools only), L1+L2 (host pools --hicache-ratio times the
device's, write-through) and L1+L2+L3 (plus the file backend in a fresh temporary
directory).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from uniradix.bench import MultiTurnWorkload, run_multiturn
from uniradix.engine import Engine
from uniradix.hicache.backends.file import FileBackend


CONFIGS = ("L1", "L1+L2", "L1+L2+L3")


def run(config: str, wl: MultiTurnWorkload, a, store_dir: str) -> tuple[list, dict]:
    storage = FileBackend(store_dir) if "L3" in config else None
    eng = Engine(a.model_preset, page_size=a.page_size, max_total_tokens=a.max_total_tokens,
                 max_running_requests=a.max_running_requests, storage=storage,
                 storage_prefetch_threshold=a.prefetch_threshold,
                 storage_prefetch_policy="wait_complete",
                 enable_hierarchical_cache="L2" in config, hicache_ratio=a.hicache_ratio)
    try:
        rounds = run_multiturn(eng, wl)
        return rounds, eng.stats()
    finally:
        eng.close()


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for cfg, rounds in results.items():
        xs = [r.round for r in rounds]
        ax1.plot(xs, [100 * r.hit_rate for r in rounds], marker="o", label=cfg)
        ax2.plot(xs, [r.input_throughput for r in rounds], marker="o", label=cfg)
    ax1.set(xlabel="round", ylabel="hit rate (%)", ylim=(0, 100), title="cached / prompt tokens per round")
    ax2.set(xlabel="round", ylabel="input tokens / s", title="effective input throughput")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--first-round-tokens", type=int, default=768, help="each client's own document")
    p.add_argument("--tokens-per-round", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--shared-prefix-tokens", type=int, default=0)
    p.add_argument("--model-preset", default="tiny-hybrid")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=4096, help="the device (L1) pools")
    p.add_argument("--hicache-ratio", type=float, default=4.0, help="the host (L2) pools, times L1")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--prefetch-threshold", type=int, default=64)
    p.add_argument("--plot", default="multiturn_tiers.png", help="PNG path ('' for none)")
    a = p.parse_args()
    wl = MultiTurnWorkload(clients=a.clients, rounds=a.rounds, tokens_per_round=a.tokens_per_round,
                           output_tokens=a.output_tokens, shared_prefix_tokens=a.shared_prefix_tokens,
                           first_round_tokens=a.first_round_tokens)
    first = a.clients * (a.shared_prefix_tokens + wl.first_tokens + a.output_tokens)
    final = a.clients * wl.final_context
    host = int(a.max_total_tokens * a.hicache_ratio)
    print(f"{a.model_preset}, {wl.clients} clients x {wl.rounds} rounds: a {wl.first_tokens}-token document "
          f"each, then {wl.tokens_per_round} new and {wl.output_tokens} output tokens per round; "
          f"working set {first} tokens after round 1, {final} at the end; device pools (L1) "
          f"{a.max_total_tokens} tokens, host pools (L2) {host}; page size {a.page_size}")
    results, stats = {}, {}
    with tempfile.TemporaryDirectory(prefix="uniradix-l3-") as d:
        for cfg in CONFIGS:
            results[cfg], stats[cfg] = run(cfg, wl, a, os.path.join(d, cfg))
    names = list(results)
    print("round " + " ".join(f"{'hit ' + c:>12} {'tok/s ' + c:>14}" for c in names))
    for i in range(wl.rounds):
        print(f"{i + 1:>5} " + " ".join(f"{results[c][i].hit_rate:>12.1%} {results[c][i].input_throughput:>14,.0f}"
                                        for c in names))
    errors = {c: sum(r.errors for r in rs) for c, rs in results.items()}
    if any(errors.values()):
        print(f"ERRORS (failed requests; their prompts count as uncached): {errors}")
    q = max(1, wl.rounds // 4)
    summary = {}
    for c in names:
        last = results[c][-q:]
        summary[c] = dict(
            hit_rate_last_quarter=sum(r.cached_tokens for r in last) / sum(r.prompt_tokens for r in last),
            input_throughput_last_quarter=sum(r.prompt_tokens for r in last) / sum(r.wall_s for r in last),
            ttft_mean_ms_last_quarter=1e3 * statistics.fmean(t for r in last for t in r.ttfts))
        print(f"last {q} rounds, {c}: hit rate {summary[c]['hit_rate_last_quarter']:.1%}, "
              f"{summary[c]['input_throughput_last_quarter']:,.0f} input tok/s, "
              f"TTFT {summary[c]['ttft_mean_ms_last_quarter']:.1f} ms")
    for c in names:
        s = stats[c]
        print(f"{c}: {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens cached, {s['host_tokens']} "
              f"loaded from L2 and {s['storage_tokens']} from L3; {s['preemptions']} preemptions, "
              f"{s['errors']} errors")
    base = summary["L1"]["input_throughput_last_quarter"]
    for c in names[1:]:
        print(f"{c} / L1 input throughput, last {q} rounds: {summary[c]['input_throughput_last_quarter'] / base:.2f}")
    if a.plot:
        plot(results, a.plot, f"{a.model_preset}: {wl.clients} clients, device pools {a.max_total_tokens} tokens")
        print(f"plot: {a.plot}")
    print(json.dumps({"summary": summary,
                      "rounds": {c: [r.as_dict() for r in rs] for c, rs in results.items()}}))


if __name__ == "__main__":
    main()
