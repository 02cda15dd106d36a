"""The cliff: many clients, each extending one conversation for many rounds, on the
reference engine, with the device cache alone and with shared storage under it, in
one run. The working set outgrows the device pools mid-run; from then on the device
alone serves almost nothing, and storage keeps the hit rate up.

    pip install -e ".[plots]"   # matplotlib, for the PNG
    python benchmarks/multiturn_tiers.py [--clients 16 --rounds 12 --max-total-tokens 4096]

Prints per round the hit rate (cached prefix tokens / prompt tokens, summed over the
round) and effective input throughput (prompt tokens per second of the round, cached
ones included) per configuration, writes a PNG of both (--plot), and ends with one
JSON line. Configurations: L1 (device pools only) and L1+L3 (the file backend in a
fresh temporary directory). L1+L2 and L1+L2+L3 join when the host tier lands.
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


def run(config: str, wl: MultiTurnWorkload, a, store_dir: str) -> list:
    storage = FileBackend(store_dir) if "L3" in config else None
    eng = Engine(a.model_preset, page_size=a.page_size, max_total_tokens=a.max_total_tokens,
                 max_running_requests=a.max_running_requests, storage=storage,
                 storage_prefetch_threshold=a.prefetch_threshold,
                 storage_prefetch_policy="wait_complete")
    try:
        return run_multiturn(eng, wl)
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
    p.add_argument("--tokens-per-round", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--shared-prefix-tokens", type=int, default=0)
    p.add_argument("--model-preset", default="tiny-hybrid")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=4096, help="the device (L1) pools")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--prefetch-threshold", type=int, default=64)
    p.add_argument("--plot", default="multiturn_tiers.png", help="PNG path ('' for none)")
    a = p.parse_args()
    wl = MultiTurnWorkload(clients=a.clients, rounds=a.rounds, tokens_per_round=a.tokens_per_round,
                           output_tokens=a.output_tokens, shared_prefix_tokens=a.shared_prefix_tokens)
    final = a.clients * (a.shared_prefix_tokens + a.rounds * (a.tokens_per_round + a.output_tokens))
    print(f"{a.model_preset}, {wl.clients} clients x {wl.rounds} rounds, {wl.tokens_per_round} new and "
          f"{wl.output_tokens} output tokens per round; device pools {a.max_total_tokens} tokens, "
          f"final working set {final} tokens; page size {a.page_size}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="uniradix-l3-") as d:
        for cfg in ("L1", "L1+L3"):
            results[cfg] = run(cfg, wl, a, os.path.join(d, cfg))
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
