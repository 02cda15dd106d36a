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
configuration, writes a PNG of both (--plot; skipped, with how to install matplotlib,
when it is missing), and ends with one JSON line.
Configurations: L1 (device pools only), L1+L2 (host pools --hicache-ratio times the
device's, write-through) and L1+L2+L3 (plus the file backend in a fresh temporary
directory for each run).

Timings on a shared machine drift, so the configurations are interleaved rather than
run one after another: each of the --repeats passes runs every configuration once,
starting with a different one each pass, and the tables give the median throughput and
TTFT over the passes (the ratios against L1 are ratios of those medians). Hit rates do
not depend on timing: the run says whether they were identical in every pass.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from uniradix.bench import MultiTurnWorkload, run_multiturn
from uniradix.config import EngineConfig
from uniradix.engine import Engine
from uniradix.hicache.backends.file import FileBackend


CONFIGS = ("L1", "L1+L2", "L1+L2+L3")


def run(config: str, wl: MultiTurnWorkload, a, store_dir: str) -> tuple[list, dict]:
    storage = FileBackend(store_dir) if "L3" in config else None
    settings = dict(page_size=a.page_size, max_total_tokens=a.max_total_tokens,
                    max_running_requests=a.max_running_requests, prefetch_threshold=a.prefetch_threshold,
                    hicache_storage_prefetch_policy="wait_complete",
                    enable_hierarchical_cache="L2" in config, hicache_ratio=a.hicache_ratio)
    # a tier this configuration leaves out takes none of its settings (an Engine refuses them)
    eng = Engine(a.model_preset, storage=storage, **EngineConfig.only_in_effect(settings, store=storage is not None))
    try:
        rounds = run_multiturn(eng, wl)
        return rounds, eng.stats()
    finally:
        eng.close()


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
    p.add_argument("--repeats", type=int, default=3,
                   help="passes over the configurations, interleaved; tables give medians")
    p.add_argument("--plot", default="multiturn_tiers.png", help="PNG path ('' for none)")
    a = p.parse_args()
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    wl = MultiTurnWorkload(clients=a.clients, rounds=a.rounds, tokens_per_round=a.tokens_per_round,
                           output_tokens=a.output_tokens, shared_prefix_tokens=a.shared_prefix_tokens,
                           first_round_tokens=a.first_round_tokens)
    first = a.clients * (a.shared_prefix_tokens + wl.first_tokens + a.output_tokens)
    final = a.clients * wl.final_context
    host = int(a.max_total_tokens * a.hicache_ratio)
    print(f"{a.model_preset}, {wl.clients} clients x {wl.rounds} rounds: a {wl.first_tokens}-token document "
          f"each, then {wl.tokens_per_round} new and {wl.output_tokens} output tokens per round; "
          f"working set {first} tokens after round 1, {final} at the end; device pools (L1) "
          f"{a.max_total_tokens} tokens, host pools (L2) {host}; page size {a.page_size}; "
          f"{a.repeats} interleaved passes, medians")
    passes = {c: [] for c in CONFIGS}
    stats = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="uniradix-l3-") as d:
        for k in range(a.repeats):
            # each pass starts with a different configuration: none always runs first
            for cfg in CONFIGS[k % len(CONFIGS):] + CONFIGS[:k % len(CONFIGS)]:
                print(f"pass {k + 1}/{a.repeats}: {cfg}", file=sys.stderr, flush=True)
                rounds, st = run(cfg, wl, a, os.path.join(d, f"{cfg}-{k}"))
                passes[cfg].append(rounds)
                stats[cfg].append(st)
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
    if a.plot:
        try:
            plot(medians, a.plot, f"{a.model_preset}: {wl.clients} clients, device pools "
                                  f"{a.max_total_tokens} tokens, medians of {a.repeats}")
            print(f"plot: {a.plot}")
        except ImportError:  # the tables above are the result; the PNG is optional
            print('plot skipped: matplotlib is not installed (pip install -e ".[plots]" for the PNG, '
                  "or --plot '' for none)")
    print(json.dumps({"repeats": a.repeats, "summary": summary, "rounds": medians,
                      "passes": {c: [[r.as_dict() for r in rs] for rs in passes[c]] for c in names}}))


if __name__ == "__main__":
    main()
