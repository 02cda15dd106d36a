"""Prefill reuse: the same multi-turn workload with the radix cache on and off, in one
run, for a full-attention-only model and hybrids with sliding-window (F+S), recurrent
(F+M) and all three kinds of layers (F+S+M).

    python benchmarks/prefill_reuse.py [--clients 4 --rounds 8 --tokens-per-round 128]

For each model it prints mean TTFT and effective input throughput (prompt tokens per
second of wall time, cached tokens included) with the cache off and on, and the ratio
cached / uncached; the hit rate is cached prefix tokens over prompt tokens, summed over
all rounds. A short discarded warm-up runs first for each model. With --repeats N each figure is the median of N runs. The last line is one
JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics

from uniradix.bench import MultiTurnWorkload, run_multiturn
from uniradix.engine import Engine

MODELS = [("F only", "full-only"), ("F+S", "gpt-oss-like"), ("F+M", "qwen3-next-like"),
          ("F+S+M", "tiny-hybrid")]


def measure(preset: str, wl: MultiTurnWorkload, cache: bool, a) -> dict:
    eng = Engine(preset, page_size=a.page_size, max_total_tokens=a.max_total_tokens,
                 chunked_prefill_size=a.chunked_prefill_size, disable_radix_cache=not cache,
                 device=a.device)
    rounds = run_multiturn(eng, wl)
    prompt = sum(r.prompt_tokens for r in rounds)
    ttfts = [t for r in rounds for t in r.ttfts]
    return dict(ttft_ms=1e3 * statistics.fmean(ttfts),
                input_tok_s=prompt / sum(r.wall_s for r in rounds),
                hit_rate=sum(r.cached_tokens for r in rounds) / prompt,
                computed=sum(r.computed_tokens for r in rounds),
                errors=sum(r.errors for r in rounds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tokens-per-round", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--shared-prefix-tokens", type=int, default=64)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--chunked-prefill-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", default=",".join(m for _, m in MODELS),
                   help="comma-separated presets (default: the four above)")
    a = p.parse_args()
    wl = MultiTurnWorkload(clients=a.clients, rounds=a.rounds, tokens_per_round=a.tokens_per_round,
                           output_tokens=a.output_tokens, shared_prefix_tokens=a.shared_prefix_tokens)
    labels = dict((m, lab) for lab, m in MODELS)
    print(f"{wl.clients} clients x {wl.rounds} rounds, {wl.tokens_per_round} new tokens and "
          f"{wl.output_tokens} output tokens per round, shared prefix {wl.shared_prefix_tokens}, "
          f"page size {a.page_size}, {a.device}, median of {a.repeats}")
    head = (f"{'layers':<7} {'preset':<16} {'hit rate':>8} {'TTFT off ms':>11} {'TTFT on ms':>10} "
            f"{'TTFT off/on':>11} {'in tok/s off':>12} {'in tok/s on':>11} {'tput on/off':>11}")
    print(head)
    out = []
    for m in a.models.split(","):
        # warm-up, discarded: the first forwards in a process pay torch's lazy set-up
        measure(m, MultiTurnWorkload(clients=2, rounds=2, tokens_per_round=16, output_tokens=2), True, a)
        runs = {True: [], False: []}
        for _ in range(a.repeats):
            for cache in (False, True):
                runs[cache].append(measure(m, wl, cache, a))
        med = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in runs.items()}
        on, off = med[True], med[False]
        row = dict(layers=labels.get(m, "?"), preset=m, hit_rate=on["hit_rate"],
                   ttft_off_ms=off["ttft_ms"], ttft_on_ms=on["ttft_ms"],
                   ttft_speedup=off["ttft_ms"] / on["ttft_ms"],
                   input_tok_s_off=off["input_tok_s"], input_tok_s_on=on["input_tok_s"],
                   throughput_ratio=on["input_tok_s"] / off["input_tok_s"],
                   computed_off=off["computed"], computed_on=on["computed"],
                   errors=on["errors"] + off["errors"])
        out.append(row)
        print(f"{row['layers']:<7} {m:<16} {row['hit_rate']:>8.1%} {row['ttft_off_ms']:>11.1f} "
              f"{row['ttft_on_ms']:>10.1f} {row['ttft_speedup']:>11.2f} {row['input_tok_s_off']:>12,.0f} "
              f"{row['input_tok_s_on']:>11,.0f} {row['throughput_ratio']:>11.2f}")
    print(json.dumps({"workload": wl.__dict__, "page_size": a.page_size, "rows": out}))


if __name__ == "__main__":
    main()
