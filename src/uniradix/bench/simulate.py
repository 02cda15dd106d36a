"""`uniradix simulate LOG`: what-if planning on the real scheduler and cache. It replays
a request log that carries token ids (`uniradix serve --request-log PATH
--log-token-ids`, or any JSON lines with `input_ids` and `output_ids`) through
engine.replay (the real engine and tree, pools that only count, nothing computed) for
a grid of configurations, and prints each one's hit rate by tier (and by round), and,
with `--target`, the smallest L1 and L2 that reach a hit rate.

Order: the replay keeps the log's causality. A request is submitted once every request
that had finished before it arrived (by the log's clock: `time` minus `latency`) has
finished in the replay, so a conversation's next turn follows its last, and requests
that overlapped in the server run together here. A log without times replays one
request after another. L3 reads and writes complete before the next step (a store that
answers at once), so a replay is deterministic. The same log at the server's own
settings reuses what the server reused, request for request, when the server's batches
were made of the same requests (sequential clients); with concurrent clients, the
server's batches also depend on timing, and the figures agree closely rather than
exactly."""
from __future__ import annotations

import bisect
import itertools
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

from .hit_rate import TIERS, json_lines

#: the grid's axes: flag, setting, what a value means
AXES = (("page_size", "--page-size", "tokens per page"),
        ("max_total_tokens", "--max-total-tokens", "L1: the FULL pool in tokens"),
        ("hicache_ratio", "--hicache-ratio", "L2: host pools as a multiple of the device pools, or 'off'"),
        ("hicache_size", "--hicache-size", "L2: host pools in GB in all (instead of a ratio)"),
        ("storage", "--storage", "L3 on or off (an unbounded store that answers at once)"),
        ("radix_eviction_policy", "--radix-eviction-policy", "lru, lfu, fifo or priority"),
        ("sessions", "--sessions", "on: the requests' session ids rank what the next turn reuses last in "
                                   "eviction (session-aware); off: plain eviction order"),
        ("max_running_requests", "--max-running-requests", "requests in a batch"),
        ("chunked_prefill_size", "--chunked-prefill-size", "prefill tokens per step"),
        ("max_mamba_cache_size", "--max-mamba-cache-size", "recurrent state slots"),
        ("swa_full_tokens_ratio", "--swa-full-tokens-ratio", "SWA pool as a fraction of FULL"))
ENGINE_KEYS = ("page_size", "max_total_tokens", "radix_eviction_policy", "max_running_requests",
               "chunked_prefill_size", "max_mamba_cache_size", "swa_full_tokens_ratio", "hicache_write_policy",
               "write_through_threshold", "prefetch_threshold", "hicache_storage_prefetch_policy", "context_length",
               "allow_longer_context")


# ---------------------------------------------------------------------------- the log
@dataclass
class Logged:
    """One request of the log, as the replay needs it."""

    input_ids: list
    output_ids: list
    arrival: float
    finish: float
    session: object = None
    salt: object = None
    priority: int | None = None
    prompt_logprobs_from: int | None = None
    round: int | None = None
    cached: dict = field(default_factory=dict)  # as the server measured: tier -> tokens (None: not logged)


@dataclass
class Traffic:
    requests: list      # Logged, in arrival order
    closes: list        # (time, session id): sessions closed
    settings: dict      # the server's settings from its start line ({} if none)
    skipped: int = 0    # lines that are not replayable requests (no token ids, failed, not JSON)
    not_finished: int = 0

    @property
    def served(self) -> dict | None:
        """The hit rate the server measured over these requests, by tier (None if the
        log does not say)."""
        if not self.requests or any("cached_tokens" not in r.cached for r in self.requests):
            return None
        return _rates(sum(len(r.input_ids) for r in self.requests),
                      {t: sum(r.cached.get(t) or 0 for r in self.requests) for t in ("cached_tokens", *TIERS)})


def read_log(path: str) -> Traffic:
    """The replayable requests of a log (finished ones with token ids), its closed
    sessions and the settings of its (first) server start."""
    rows, closes, settings, skipped, not_finished = [], [], {}, 0, 0
    for i, rec in enumerate(json_lines(path)):
        if not isinstance(rec, dict):  # not JSON, or not a record
            skipped += 1
            continue
        ev = rec.get("event")
        if ev == "start":
            settings = settings or dict(rec.get("settings") or {})
            continue
        if ev == "close_session":
            if _num(rec.get("time")) is not None:
                closes.append((rec["time"], rec.get("session")))
            continue
        if ev is not None:
            continue
        ids, out = rec.get("input_ids"), rec.get("output_ids")
        if not (_ids(ids) and _ids(out)):
            skipped += 1
            continue
        if rec.get("status", "finished") != "finished":
            not_finished += 1  # failed or aborted: the server cached nothing of it
            continue
        rows.append((i, rec))
    reqs = []
    timed = all(_num(r.get("arrival")) is not None or (_num(r.get("time")) is not None
                                                       and _num(r.get("latency")) is not None) for _, r in rows)
    for n, (i, r) in enumerate(rows):
        if timed:
            finish = r["time"] if _num(r.get("time")) is not None else r["arrival"] + (r.get("latency") or 0)
            arrival = r["arrival"] if _num(r.get("arrival")) is not None else finish - r["latency"]
        else:  # one after another, in the file's order
            arrival, finish = 2.0 * n, 2.0 * n + 1
        cached = {k: r[k] for k in ("cached_tokens", *TIERS) if _num(r.get(k)) is not None}
        reqs.append(Logged(r["input_ids"], r["output_ids"], arrival, finish, r.get("session"), r.get("salt"),
                           r.get("priority"), r.get("prompt_logprobs_from"),
                           r.get("round") if type(r.get("round")) is int else None, cached))
    reqs.sort(key=lambda r: r.arrival)
    turns: dict = defaultdict(int)
    for r in reqs:  # a round is the log's own, else the turn within the session
        if r.round is None and r.session is not None:
            turns[_key(r.session)] += 1
            r.round = turns[_key(r.session)]
    if not timed:
        closes = []
    return Traffic(reqs, sorted(closes, key=lambda c: c[0]), settings, skipped, not_finished)


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(type(t) is int and t >= 0 for t in v)


def _key(session):
    return (type(session).__name__, session)


# ---------------------------------------------------------------------------- one replay
@dataclass
class Result:
    config: dict
    prompt_tokens: int = 0
    cached: dict = field(default_factory=dict)      # tier -> tokens ("cached_tokens": all)
    rounds: dict = field(default_factory=dict)      # round -> [prompt, cached]
    errors: int = 0
    preemptions: int = 0
    seconds: float = 0.0
    requests: int = 0
    sessions_open: int = 0  # session references left in the tree at the end

    @property
    def hit_rate(self) -> float:
        return self.cached.get("cached_tokens", 0) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def rates(self) -> dict:
        return _rates(self.prompt_tokens, self.cached)


def _rates(prompt: int, cached: dict) -> dict:
    return {k: (v / prompt if prompt else 0.0) for k, v in cached.items()}


def engine_settings(config: dict) -> dict:
    """The Engine settings a configuration (the grid's axes, the server's other
    settings) stands for."""
    kw = {k: config[k] for k in ENGINE_KEYS if config.get(k) is not None}
    ratio, size = config.get("hicache_ratio"), config.get("hicache_size")
    if size not in (None, "off"):
        kw.update(enable_hierarchical_cache=True, hicache_size=float(size))
    elif ratio not in (None, "off"):
        kw.update(enable_hierarchical_cache=True, hicache_ratio=float(ratio))
    return kw


def replay(traffic: Traffic, model, config: dict) -> Result:
    """Replay the traffic on `model` (a PagedModel) with one configuration."""
    from ..engine.replay import ReplayEngine, ReplayModel
    storage = None
    if config.get("storage") == "on":
        from ..hicache.backends.memory import MemoryBackend
        storage = MemoryBackend()
    t0 = time.perf_counter()
    eng = ReplayEngine(model if isinstance(model, ReplayModel) else ReplayModel(model), storage=storage,
                       **engine_settings(config))
    sessions = config.get("sessions", "on") == "on"
    res = Result(config=dict(config))
    items = [(r.arrival, 1, n) for n, r in enumerate(traffic.requests)]
    if sessions:
        items += [(t, 0, s) for t, s in traffic.closes]  # a close at the same instant goes first
    items.sort(key=lambda x: (x[0], x[1]))
    by_finish = sorted(range(len(traffic.requests)), key=lambda n: traffic.requests[n].finish)
    finishes = [traffic.requests[n].finish for n in by_finish]
    done = [False] * len(traffic.requests)
    rank = {n: i for i, n in enumerate(by_finish)}
    state = {"settled": 0, "head": 0}
    live: dict = {}

    def finished(x: int) -> None:
        done[rank[x]] = True
        while state["settled"] < len(done) and done[state["settled"]]:
            state["settled"] += 1

    def release() -> None:
        """Submit what the log says could have arrived by now, in arrival order."""
        while state["head"] < len(items):
            t, kind, x = items[state["head"]]
            if bisect.bisect_right(finishes, t) > state["settled"]:
                return
            state["head"] += 1
            if kind == 0:
                eng.close_session(x)
                continue
            r = traffic.requests[x]
            req = eng.replay(r.input_ids, r.output_ids, session_id=r.session if sessions else None, salt=r.salt,
                             priority=r.priority, prompt_logprobs_from=r.prompt_logprobs_from)
            live[req.rid] = x
            eng.submit(req)
            if req.done:  # refused at once (it cannot fit these pools)
                _count(res, r, req)
                finished(live.pop(req.rid))

    while True:
        head = state["head"]
        release()
        if not (eng.waiting or eng.running or eng.prefetching):
            if state["head"] == len(items):
                break
            if state["head"] == head:  # cannot happen: what the head waits for arrived before it
                raise RuntimeError("simulate: the replay is stuck: a request waits for one that never ran")
            continue  # what was refused at once let more arrive
        if eng.storage is not None:
            for _, fut, _ in list(eng.storage.prefetching):  # L3 answers at once
                fut.exception()
        for req in eng.step():
            x = live.pop(req.rid)
            _count(res, traffic.requests[x], req)
            finished(x)
        if eng.storage is not None:
            eng.flush_writes()
    res.sessions_open = len(eng.cache.tree.sessions)
    eng.close()
    res.preemptions = eng.counters["preemptions"]
    res.seconds = time.perf_counter() - t0
    return res


def _count(res: Result, logged: Logged, req) -> None:
    m = req.metrics
    n = len(logged.input_ids)
    res.requests += 1
    res.prompt_tokens += n
    if req.status != "finished":
        res.errors += 1
        got = dict.fromkeys(("cached_tokens", *TIERS), 0)
    else:
        got = {"cached_tokens": m.cached_tokens, "cached_device": m.cached_tokens - m.host_tokens - m.storage_tokens,
               "cached_host": m.host_tokens, "cached_storage": m.storage_tokens}
    for k, v in got.items():
        res.cached[k] = res.cached.get(k, 0) + v
    if logged.round is not None:
        a = res.rounds.setdefault(logged.round, [0, 0])
        a[0] += n
        a[1] += got["cached_tokens"]


# ---------------------------------------------------------------------------- the grid
def server_config(traffic: Traffic) -> dict:
    """The configuration the server ran with, from its start line (engine defaults for
    what it does not say)."""
    from ..config import EngineConfig
    s = {**EngineConfig().as_dict(), **traffic.settings}
    out = {k: s.get(k) for k in ENGINE_KEYS}
    out["hicache_ratio"] = s.get("hicache_ratio") if s.get("enable_hierarchical_cache") else "off"
    out["hicache_size"] = s.get("hicache_size") if s.get("enable_hierarchical_cache") else None
    if out["hicache_size"] is not None:
        out["hicache_ratio"] = None
    out["storage"] = "on" if s.get("hicache_storage_backend") else "off"
    out["sessions"] = "on"
    out["device"] = "cpu"
    return out


def grid(base: dict, axes: dict) -> list[dict]:
    """Every combination of the values given per axis, the rest as in `base`."""
    names = list(axes)
    out = []
    for combo in itertools.product(*(axes[n] for n in names)):
        c = {**base, **dict(zip(names, combo))}
        if "hicache_size" in axes and c.get("hicache_size") is not None:
            c["hicache_ratio"] = None
        elif "hicache_ratio" in axes:
            c["hicache_size"] = None
        out.append(c)
    return out


def smallest(ok, lo: int, hi: int, step: int) -> int | None:
    """The smallest multiple of `step` in [lo, hi] for which ok() holds, by bisection
    (a hit rate grows with the pool, though not strictly: the answer is the first point
    where the search finds it met), or None when not even `hi` meets it."""
    lo, hi = -(-lo // step), hi // step
    if hi < lo or not ok(hi * step):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid * step):
            hi = mid
        else:
            lo = mid + 1
    return lo * step


def load_replay_model(traffic: Traffic, model_path: str | None, model_preset: str | None, dtype: str | None):
    """The model the log was served with (or the one named): its layers, for the
    replay. A checkpoint is read whole, once."""
    from ..engine.replay import ReplayModel
    from ..model import load_model
    s = traffic.settings
    path = model_path if model_path is not None else (None if model_preset else s.get("model_path"))
    if path is not None and (path.endswith(".gguf") or not path.endswith(".safetensors")):
        import torch

        from ..model.hf import load_checkpoint
        return ReplayModel(load_checkpoint(path, getattr(torch, dtype or s.get("dtype") or "float32"),
                                           s.get("quantization") or "none"))
    return ReplayModel(load_model(model_preset or s.get("model_preset") or "tiny-hybrid"))


def _values(axis: str, text: str) -> list:
    out = []
    for v in (x.strip() for x in text.split(",")):
        if not v:
            continue
        if axis in ("storage", "sessions"):
            if v not in ("on", "off"):
                raise ValueError(f"--{axis}: use on, off or on,off, got {v!r}")
            out.append(v)
        elif axis == "radix_eviction_policy":
            out.append(v)
        elif axis in ("hicache_ratio", "hicache_size") and v == "off":
            out.append("off")
        elif axis in ("hicache_ratio", "hicache_size", "swa_full_tokens_ratio"):
            try:
                out.append(float(v))
            except ValueError:
                raise ValueError(f"--{axis.replace('_', '-')}: {v!r} is not a number") from None
        else:
            try:
                out.append(int(v))
            except ValueError:
                raise ValueError(f"--{axis.replace('_', '-')}: {v!r} is not an integer") from None
    if not out:
        raise ValueError(f"--{axis.replace('_', '-')}: give at least one value")
    return out


# ---------------------------------------------------------------------------- printing
def _tier(c: dict) -> tuple[str, str]:
    if c.get("hicache_size") not in (None, "off"):
        l2 = f"{c['hicache_size']:g} GB"
    elif c.get("hicache_ratio") not in (None, "off"):
        l2 = f"x{float(c['hicache_ratio']):g}"
    else:
        l2 = "off"
    return l2, c.get("storage", "off")


def print_results(results: list[Result], out, by_round: bool) -> None:
    head = (f"{'page':>5}{'L1 tokens':>11}{'L2':>9}{'L3':>5}{'policy':>9}{'sessions':>9}{'batch':>6}"
            f"{'hit rate':>9}{'device':>8}{'host':>7}{'storage':>8}{'preempt':>8}{'req/s':>8}")
    print(head, file=out)
    for r in results:
        c, rt = r.config, r.rates
        l2, l3 = _tier(c)
        print(f"{c.get('page_size'):>5}{c.get('max_total_tokens'):>11,}{l2:>9}{l3:>5}"
              f"{c.get('radix_eviction_policy'):>9}{c.get('sessions'):>9}{c.get('max_running_requests'):>6}"
              f"{r.hit_rate:>9.1%}{rt.get('cached_device', 0):>8.1%}{rt.get('cached_host', 0):>7.1%}"
              f"{rt.get('cached_storage', 0):>8.1%}{r.preemptions:>8}{r.requests / max(r.seconds, 1e-9):>8.0f}",
              file=out)
        if r.errors:
            print(f"      {r.errors} request(s) could not run in this configuration (the pools cannot hold them)",
                  file=out)
    if by_round and any(r.rounds for r in results):
        print(file=out)
        rounds = sorted({k for r in results for k in r.rounds})
        print("hit rate by round" + "".join(f"{k:>8}" for k in rounds), file=out)
        for i, r in enumerate(results, 1):
            cells = "".join(f"{(r.rounds[k][1] / r.rounds[k][0] if r.rounds.get(k) and r.rounds[k][0] else 0):>8.1%}"
                            if k in r.rounds else f"{'-':>8}" for k in rounds)
            print(f"{'config ' + str(i):<17}{cells}", file=out)


def main(a) -> int:
    out = sys.stdout
    try:
        traffic = read_log(a.log)
    except OSError as e:
        print(f"uniradix simulate: {a.log}: {e.strerror or e}", file=sys.stderr)
        return 2
    if not traffic.requests:
        print(f"uniradix simulate: {a.log}: no request with token ids to replay ({traffic.skipped} line(s) "
              f"skipped); log them with `uniradix serve --request-log PATH --log-token-ids`", file=sys.stderr)
        return 1
    try:
        base = server_config(traffic)
        axes = {axis: _values(axis, getattr(a, axis)) for axis, _, _ in AXES if getattr(a, axis) is not None}
        if a.target is not None and not 0 < a.target <= 1:
            raise ValueError(f"--target must be a hit rate in (0, 1], got {a.target}")
        model = load_replay_model(traffic, a.model_path, a.model_preset, a.dtype)
        configs = grid(base, axes)
        for c in configs:  # every setting checked before the first replay
            from ..config import EngineConfig
            EngineConfig.of(**engine_settings(c))
    except (ValueError, OSError, ImportError) as e:
        print(f"uniradix simulate: {e}", file=sys.stderr)
        return 2
    n = len(traffic.requests)
    prompt = sum(len(r.input_ids) for r in traffic.requests)
    print(f"{n:,} requests ({prompt:,} prompt tokens) from {a.log}; model {model.inner.name}, components "
          f"{', '.join(s.name for s in model.states().specs)}", file=out)
    if traffic.not_finished or traffic.skipped:
        print(f"not replayed: {traffic.not_finished} failed or aborted request(s), {traffic.skipped} line(s) "
              f"without token ids", file=out)
    served = traffic.served
    if served is not None:
        print(f"as served: hit rate {served['cached_tokens']:.1%} (device {served.get('cached_device', 0):.1%}, "
              f"host {served.get('cached_host', 0):.1%}, storage {served.get('cached_storage', 0):.1%})", file=out)
    print(file=out)
    results = []
    for c in configs:
        results.append(replay(traffic, model, c))
    print_results(results, out, a.by_round)
    if a.target is not None:
        print(file=out)
        _targets(traffic, model, configs, a.target, out)
    return 0


def _targets(traffic: Traffic, model, configs: list[dict], target: float, out) -> None:
    """Per configuration apart from its sizes: the smallest L1 alone that reaches the
    target, then, for each L1 of the grid that has an L2, the smallest L2 over it."""
    total = sum(len(r.input_ids) + len(r.output_ids) for r in traffic.requests)
    largest = max(len(r.input_ids) + len(r.output_ids) for r in traffic.requests)
    print(f"target hit rate {target:.0%}:", file=out)
    groups: dict = {}
    for c in configs:
        key = json.dumps({k: v for k, v in c.items() if k not in ("max_total_tokens", "hicache_ratio", "hicache_size")},
                         sort_keys=True, default=str)
        groups.setdefault(key, []).append(c)
    for cs in groups.values():
        c = cs[0]
        P = c["page_size"]
        l1 = {**c, "hicache_ratio": "off", "hicache_size": None}
        got = smallest(lambda m: replay(traffic, model, {**l1, "max_total_tokens": m}).hit_rate >= target,
                       largest, -(-max(total, largest) // P) * P, P)
        print(f"  {c['radix_eviction_policy']}, sessions {c['sessions']}, L3 {c.get('storage', 'off')}, page {P}, "
              f"batch {c['max_running_requests']}: L1 alone "
              + (f"needs --max-total-tokens {got:,}" if got is not None
                 else "cannot reach it (with everything cached it reuses less)"), file=out)
        for L1 in sorted({x["max_total_tokens"] for x in cs
                          if _tier(x)[0] != "off"}):
            if L1 < largest:
                print(f"    over L1 {L1:,}: L1 holds less than the largest request ({largest:,} tokens)", file=out)
                continue
            over = {**c, "max_total_tokens": L1, "hicache_size": None}
            got = smallest(lambda h: replay(traffic, model, {**over, "hicache_ratio": h / L1}).hit_rate >= target,
                           L1 + P, max(2 * L1, -(-total // P) * P), P)
            print(f"    over L1 {L1:,}: " + (f"an L2 of {got:,} tokens (--hicache-ratio {got / L1:.2f})"
                                             if got is not None else "cannot reach it with L2"), file=out)


def add_args(p) -> None:
    p.add_argument("log", help="a JSON-lines request log with token ids (uniradix serve --request-log PATH "
                               "--log-token-ids), or '-' for standard input")
    p.add_argument("--model-path", help="the checkpoint the traffic was served with (default: the log's)")
    p.add_argument("--model-preset", help="an embedded model's preset instead (default: the log's)")
    p.add_argument("--dtype", help="the checkpoint's dtype (default: the log's; it prices --hicache-size)")
    for axis, flag, what in AXES:
        p.add_argument(flag, dest=axis, metavar="V[,V...]",
                       help=f"{what}; comma-separated values make a grid (default: as the log's server ran)")
    p.add_argument("--target", type=float, help="a hit rate (0.9: 90%%): print the smallest L1 alone, and the "
                                                "smallest L2 over each L1 with L2, that reach it")
    p.add_argument("--by-round", action="store_true", help="also print each configuration's hit rate by round "
                                                          "(the log's rounds, else the turn in the session)")
