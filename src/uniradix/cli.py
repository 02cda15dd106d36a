"""`uniradix`: command-line entry points. `uniradix run` serves a multi-turn workload
on the embedded reference model and prints the hit rate, TTFT and input throughput
per round. Engine flags follow SGLang's names."""
from __future__ import annotations

import argparse
import json
import math
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from .model import PRESETS
    from .tree import POLICIES
    g = p.add_argument_group("engine (SGLang's flag names)")
    g.add_argument("--model-preset", default="tiny-hybrid", choices=sorted(PRESETS),
                   help="layer layout of the embedded reference model (tiny-hybrid: F+S+M)")
    g.add_argument("--model-path", default=None,
                   help="a safetensors file of weights for the preset (default: seeded weights)")
    g.add_argument("--page-size", type=int, default=1, help="tokens per KV page")
    g.add_argument("--max-total-tokens", type=int, default=16384, help="FULL KV pool size in tokens")
    g.add_argument("--swa-full-tokens-ratio", type=float, default=1.0,
                   help="SWA KV pool size as a fraction of the FULL pool")
    g.add_argument("--max-mamba-cache-size", type=int, default=None,
                   help="recurrent state slots for running requests and checkpoints "
                        "(default: 4 x max running requests + 64)")
    g.add_argument("--chunked-prefill-size", type=int, default=256, help="prefill tokens per step")
    g.add_argument("--max-running-requests", type=int, default=16, help="requests in a batch")
    g.add_argument("--radix-eviction-policy", default="lru", choices=POLICIES, help="eviction order")
    g.add_argument("--disable-radix-cache", action="store_true", help="reuse nothing (the baseline)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--enable-hierarchical-cache", action="store_true",
                   help="add the host tier (L2): host copies of every pool, loaded back layer by layer")
    g.add_argument("--hicache-ratio", type=float, default=2.0,
                   help="host pools as a multiple of the device pools (must be > 1)")
    g.add_argument("--hicache-size", type=float, default=0,
                   help="host pools in GB in all; overrides --hicache-ratio (0: use the ratio)")
    g.add_argument("--hicache-storage-backend", default=None,
                   choices=["file", "redis", "mooncake", "dynamic"],
                   help="L3 shared storage: finished work is written through, deeper prefixes are loaded")
    g.add_argument("--hicache-storage-backend-extra-config", default=None,
                   help="backend settings as a JSON object or @file (path, url, prefix, ...; "
                        "prefetch_threshold: tokens beyond the device hit worth a load, default 256; "
                        "prefetch_timeout_base / _per_ki_token / _max in seconds, default 1 / 0.25 / 3)")
    g.add_argument("--hicache-write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="when data goes down a tier: when cached (write_through), once reused "
                        "--write-through-threshold times (write_through_selective), or when it leaves "
                        "the tier above (write_back, needs --enable-hierarchical-cache)")
    g.add_argument("--write-through-threshold", type=int, default=2,
                   help="accesses before write_through_selective writes a prefix")
    g.add_argument("--hicache-storage-prefetch-policy", default="best_effort",
                   choices=["best_effort", "wait_complete", "timeout"],
                   help="how long a request waits for its L3 read")


def engine_from_args(a: argparse.Namespace):
    from .engine import Engine
    from .model import preset
    cfg = preset(a.model_preset)
    weights = a.model_path  # a file the engine loads (and fingerprints for L3), or seeded weights
    storage, prefetch = None, {}
    if a.hicache_storage_backend:
        from .hicache.backends import make_backend, parse_extra_config
        extra = parse_extra_config(a.hicache_storage_backend_extra_config)
        prefetch = tier_settings(extra)
        storage = make_backend(a.hicache_storage_backend, extra)
    return Engine(cfg, weights=weights, storage=storage,
                  storage_prefetch_policy=a.hicache_storage_prefetch_policy, **prefetch,
                  hicache_write_policy=a.hicache_write_policy,
                  enable_hierarchical_cache=a.enable_hierarchical_cache, hicache_ratio=a.hicache_ratio,
                  hicache_size=a.hicache_size or None,
                  write_through_threshold=a.write_through_threshold,
                  page_size=a.page_size, max_total_tokens=a.max_total_tokens,
                  swa_full_tokens_ratio=a.swa_full_tokens_ratio,
                  max_mamba_cache_size=a.max_mamba_cache_size,
                  chunked_prefill_size=a.chunked_prefill_size,
                  max_running_requests=a.max_running_requests,
                  radix_eviction_policy=a.radix_eviction_policy,
                  disable_radix_cache=a.disable_radix_cache, device=a.device)


#: extra-config keys the storage tier reads itself (the rest configure the backend):
#: name -> (Engine keyword, check)
def _count(v) -> bool:
    return type(v) is int and v >= 0


def _seconds(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v >= 0


def _name(v) -> bool:
    return isinstance(v, str) and bool(v)


TIER_SETTINGS = {
    "prefetch_threshold": ("storage_prefetch_threshold", _count, "an int >= 0 (tokens)"),
    "prefetch_timeout_base": ("prefetch_timeout_base", _seconds, "a finite number >= 0 (seconds)"),
    "prefetch_timeout_per_ki_token": ("prefetch_timeout_per_ki_token", _seconds,
                                      "a finite number >= 0 (seconds per 1024 tokens)"),
    "prefetch_timeout_max": ("prefetch_timeout_max", _seconds, "a finite number >= 0 (seconds)"),
    "model_fingerprint": ("model_fingerprint", _name, "a non-empty string (the model's name in the store)"),
    "auth_secret": ("storage_secret", _name, "a non-empty string (the key of the objects' MAC)"),
}


def tier_settings(extra: dict) -> dict:
    """The storage tier's own settings from the extra config, checked (JSON types
    included: null, strings and NaN are refused), as Engine keywords."""
    unknown = sorted(k for k in extra if k.startswith("prefetch_") and k not in TIER_SETTINGS)
    if unknown:
        raise ValueError(f"--hicache-storage-backend-extra-config: unknown prefetch setting(s) {unknown}; "
                         f"known: {', '.join(TIER_SETTINGS)}")
    out = {}
    for key, (kw, ok, what) in TIER_SETTINGS.items():
        if key in extra:
            v = extra[key]
            if not ok(v):
                shown = "<hidden>" if key == "auth_secret" else repr(v)
                raise ValueError(f"--hicache-storage-backend-extra-config: {key} must be {what}, got {shown}")
            out[kw] = v
    return out


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-turn workload")
    g.add_argument("--clients", type=int, default=8, help="conversations in flight together")
    g.add_argument("--rounds", type=int, default=8, help="turns per conversation")
    g.add_argument("--tokens-per-round", type=int, default=128, help="new user tokens each turn")
    g.add_argument("--first-round-tokens", type=int, default=None,
                   help="each client's own tokens in its first turn, e.g. a document (default: --tokens-per-round)")
    g.add_argument("--output-tokens", type=int, default=16, help="tokens generated each turn")
    g.add_argument("--shared-prefix-tokens", type=int, default=128,
                   help="a system prompt every conversation opens with")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated conversations")


def workload_from_args(a: argparse.Namespace):
    from .bench import MultiTurnWorkload
    return MultiTurnWorkload(clients=a.clients, rounds=a.rounds, tokens_per_round=a.tokens_per_round,
                             output_tokens=a.output_tokens, shared_prefix_tokens=a.shared_prefix_tokens,
                             seed=a.seed, first_round_tokens=a.first_round_tokens)


def cmd_run(a: argparse.Namespace) -> int:
    from .bench import run_multiturn
    try:
        wl = workload_from_args(a)
        engine = engine_from_args(a)
    except (ValueError, OSError, ImportError, RuntimeError) as e:  # RuntimeError: StorageUnavailable
        print(f"uniradix run: {e}", file=sys.stderr)
        return 2
    cfg = engine.cfg
    print(f"uniradix run: {a.model_preset} (layers {cfg.pattern}), page size {a.page_size}, "
          f"{wl.clients} clients x {wl.rounds} rounds, {wl.tokens_per_round} new tokens and "
          f"{wl.output_tokens} output tokens per round, shared prefix {wl.shared_prefix_tokens}, "
          f"cache {'off' if a.disable_radix_cache else 'on'}, device {engine.device}")
    bar = None
    if not a.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=wl.requests, desc="requests", unit="req", file=sys.stderr, leave=False)
    try:
        reports = run_multiturn(engine, wl, (lambda r: bar.update(1)) if bar else None)
    finally:
        engine.close()
        if engine.l3 is not None:
            engine.l3.backend.close()  # the run made it: it reports what it has not logged yet
        if bar:
            bar.close()
    failed = sum(r.errors for r in reports)
    if a.json:
        print(json.dumps({"rounds": [r.as_dict() for r in reports], "engine": _plain(engine.stats())}))
    else:
        _print_rounds(reports)
        _print_engine(engine, a)
    if failed:
        why = list(dict.fromkeys(m for r in reports for m in r.error_messages))
        print(f"uniradix run: {failed} of {sum(r.requests for r in reports)} requests failed; "
              f"{'the reason' if len(why) == 1 else 'reasons'}: " + "; ".join(why[:3])
              + (f" (and {len(why) - 3} more)" if len(why) > 3 else ""), file=sys.stderr)
        return 1
    return 0


def _fmt(x, spec: str, width: int) -> str:
    """A figure, or '-' where there is none (a round that served nothing)."""
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def _print_rounds(reports) -> None:
    print(f"{'round':>5} {'prompt tok':>10} {'cached tok':>10} {'hit rate':>8} "
          f"{'TTFT ms':>8} {'input tok/s':>11} {'errors':>6}")
    for r in reports:
        ttft = None if r.ttft_mean is None else r.ttft_mean * 1e3
        print(f"{r.round:>5} {r.prompt_tokens:>10} {r.cached_tokens:>10} {_fmt(r.hit_rate, '.1%', 8)} "
              f"{_fmt(ttft, '.1f', 8)} {_fmt(r.input_throughput, ',.0f', 11)} {r.errors:>6}")
    tp = sum(r.prompt_tokens for r in reports)
    tc = sum(r.cached_tokens for r in reports)
    wall = sum(r.wall_s for r in reports if r.served)
    ttfts = [t for r in reports for t in r.ttfts]
    print(f"{'all':>5} {tp:>10} {tc:>10} {_fmt(tc / tp if tp else None, '.1%', 8)} "
          f"{_fmt(sum(ttfts) / len(ttfts) * 1e3 if ttfts else None, '.1f', 8)} "
          f"{_fmt(tp / wall if tp and wall > 0 else None, ',.0f', 11)} {sum(r.errors for r in reports):>6}")


def _print_engine(engine, a) -> None:
    s = engine.stats()
    ev = s["cache"]["components"]["full"]["evicted"]
    print(f"hit rate = cached prefix tokens / prompt tokens of the requests served, summed per round; "
          f"input tok/s counts cached tokens too.\nengine: {s['prefill_tokens']} prefill and {s['decode_tokens']} decode "
          f"tokens computed, {s['preemptions']} preemptions, {ev} FULL pages evicted, {s['errors']} errors")
    if engine.hierarchical:
        h = s["cache"]["host"]
        full = s["cache"]["components"]["full"]
        print(f"L2 (host, {full['host_pool_size']} FULL pages): {s['host_tokens']} prompt tokens loaded back "
              f"in {h['loads']} loads ({h['failed_loads']} could not fit), {h['written_handles'] + h['written_back']} "
              f"handles written ({a.hicache_write_policy}), {full['offloaded']} FULL pages left the device "
              f"as host copies, {full['host_evicted']} host pages evicted")
    if a.hicache_storage_backend:
        print(f"L3 ({a.hicache_storage_backend}): {s['storage_tokens']} prompt tokens loaded in "
              f"{s['storage_loads']} loads ({s['storage_failed_loads']} failed), "
              f"{s['storage_saved_objects']} objects written, {s['storage_errors']} errors")


def _plain(x):
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (int, float, str, bool)) or x is None else str(x)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default once: not for flags whose help already says it, nor None/False."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h or action.default in (None, False):
            return h
        return super()._get_help_string(action)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="uniradix", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", formatter_class=_HelpFormatter, help="serve a multi-turn workload on the embedded model; print hit rate, "
                                   "TTFT and input throughput per round")
    add_engine_args(r)
    add_workload_args(r)
    r.add_argument("--json", action="store_true", help="print the rounds as JSON instead of a table")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run)
    a = p.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
