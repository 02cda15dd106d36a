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
exactly.

The log is read once, each line checked (log_records: a bad one is one line naming its
line and field, exit 2, or passed over with --skip-bad-lines); what is kept of a request
is where its line is, its times and its round, and its ids are read back when the
replay submits it, so memory grows by a few numbers a request, never by its tokens."""
from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import json
import shutil
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field

from .log_records import (
    CLOSE,
    MAX_LINE_BYTES,
    REQUEST,
    START,
    TIERS,
    BadLines,
    BadRecord,
    check_request,
    first_start,
    parse,
    records,
)

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
        ("swa_full_tokens_ratio", "--swa-full-tokens-ratio", "SWA pool as a fraction of FULL"),
        ("swa_retention", "--swa-retention", "spare (every window page of a prompt, evicted first) or "
                                             "windows (only where requests resume)"))
ENGINE_KEYS = ("page_size", "max_total_tokens", "radix_eviction_policy", "swa_retention", "max_running_requests",
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


class Requests:
    """The replayable requests of a log, in arrival order, held as where each one's line
    is and its times: its token ids and other fields are read back from the file when
    the replay submits it (checked again), so memory grows by a few numbers a request,
    never by its tokens. `reader()` opens the file once for many reads."""

    def __init__(self, path: str, offsets: array, lines: array, arrival: array, finish: array, rounds: array,
                 vocab: int | None, spool=None) -> None:
        self.path, self.offsets, self.lines = path, offsets, lines
        self.arrival, self.finish, self.rounds = arrival, finish, rounds
        self.vocab = vocab
        self._spool = spool  # standard input, copied to a temporary file (kept while this lives)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> Logged:
        with self.reader() as get:
            return get(i)

    def __iter__(self):
        with self.reader() as get:
            for i in range(len(self)):
                yield get(i)

    @contextlib.contextmanager
    def reader(self, vocab: int | None = None):
        """get(i) -> Logged, the file open meanwhile; ids checked against `vocab` (the
        replay's model's) or the one the log was read with."""
        vocab = self.vocab if vocab is None else vocab
        with open(self.path, "rb") as f:
            yield lambda i: self._read(f, i, vocab)

    def _read(self, f, i: int, vocab: int | None) -> Logged:
        if i < 0:
            i += len(self)
        n = self.lines[i]
        f.seek(self.offsets[i])
        raw = f.readline(MAX_LINE_BYTES + 1)
        rec = check_request(n, parse(n, raw), vocab)
        ids, out = rec.get("input_ids"), rec.get("output_ids")
        if not ids or not out:
            raise BadRecord(n, None, "changed while the log was read: no longer the request it was")
        return Logged(ids, out, self.arrival[i], self.finish[i], rec.get("session"), rec.get("salt"),
                      rec.get("priority"), rec.get("prompt_logprobs_from"),
                      None if self.rounds[i] < 0 else self.rounds[i],
                      {k: rec[k] for k in ("cached_tokens", *TIERS) if rec.get(k) is not None})


class InMemory(list):
    """Requests given as a list of Logged (a program's own traffic), with the interface
    the replay reads (`arrival`, `finish`, `reader()`)."""

    @property
    def arrival(self) -> array:
        return array("d", (r.arrival for r in self))

    @property
    def finish(self) -> array:
        return array("d", (r.finish for r in self))

    @contextlib.contextmanager
    def reader(self, vocab: int | None = None):
        yield self.__getitem__


@dataclass
class Traffic:
    requests: object    # Requests (or a list of Logged), in arrival order
    closes: list        # (time, session id, salt): sessions closed (a session is its salt's)
    settings: dict      # the server's settings from its start line ({} if none)
    skipped: int = 0    # request lines that are not replayable (without token ids)
    not_finished: int = 0
    settings_line: int | None = None  # the start line's number in the log
    prompt_tokens: int = 0            # over the requests
    total_tokens: int = 0             # prompt and output tokens over the requests
    largest: int = 0                  # the most tokens of one request
    served_cached: dict | None = None  # tier -> cached tokens as the server measured (None: not logged)

    def __post_init__(self) -> None:
        if isinstance(self.requests, list) and not isinstance(self.requests, InMemory):
            self.requests = InMemory(self.requests)
        if isinstance(self.requests, InMemory) and self.requests:
            rs = self.requests
            self.prompt_tokens = sum(len(r.input_ids) for r in rs)
            self.total_tokens = sum(len(r.input_ids) + len(r.output_ids) for r in rs)
            self.largest = max(len(r.input_ids) + len(r.output_ids) for r in rs)
            if all("cached_tokens" in r.cached for r in rs):
                self.served_cached = {t: sum(r.cached.get(t) or 0 for r in rs) for t in ("cached_tokens", *TIERS)}

    @property
    def served(self) -> dict | None:
        """The hit rate the server measured over these requests, by tier (None if the
        log does not say)."""
        if not len(self.requests) or self.served_cached is None:
            return None
        return _rates(self.prompt_tokens, self.served_cached)


def read_log(path: str, vocab=None, bad=None) -> Traffic:
    """The replayable requests of a log (finished ones with token ids), its closed
    sessions and the settings of its (first) server start, every line checked
    (log_records; `bad`: told of each bad line, else BadRecord is raised). `vocab`: the
    vocabulary ids are checked against, or a function of the first start line's
    settings and number ({} and None without one) that gives it (it loads the model the
    replay runs on). One pass,
    keeping per request where its line is and its times; '-' reads standard input
    into a temporary file first."""
    spool = None
    if path == "-":
        spool = tempfile.NamedTemporaryFile(prefix="uniradix-simulate-", suffix=".jsonl")  # noqa: SIM115 (kept)
        shutil.copyfileobj(sys.stdin.buffer, spool)
        spool.flush()
    source = spool.name if spool is not None else path
    offsets, lines, arrival, finish, rounds, sessions = (array("q"), array("q"), array("d"), array("d"),
                                                         array("q"), array("q"))
    session_ids: dict = {}
    closes, settings, settings_line = [], {}, None
    skipped = not_finished = prompt = total = largest = 0
    served = dict.fromkeys(("cached_tokens", *TIERS), 0)
    served_all = timed = True
    with open(source, "rb") as f:
        if callable(vocab):
            found = first_start(f)
            vocab = vocab(*((found[1]["settings"], found[0]) if found else ({}, None)))
            f.seek(0)
        for n, offset, kind, rec in records(f, vocab, bad):
            if kind == START:
                if settings_line is None:
                    settings, settings_line = dict(rec["settings"]), n
                continue
            if kind == CLOSE:
                closes.append((rec["time"], rec["session"], rec.get("salt")))
                continue
            if kind != REQUEST:
                continue
            ids, out = rec.get("input_ids"), rec.get("output_ids")
            if ids is None or out is None:
                skipped += 1
                continue
            if rec.get("status", "finished") != "finished":
                not_finished += 1  # failed or aborted: the server cached nothing of it
                continue
            offsets.append(offset)
            lines.append(n)
            t, lat, arr = rec.get("time"), rec.get("latency"), rec.get("arrival")
            if timed and (arr is not None or (t is not None and lat is not None)):
                end = t if t is not None else arr + (lat or 0)
                arrival.append(arr if arr is not None else end - lat)
                finish.append(end)
            else:
                timed = False
            r, s = rec.get("round"), rec.get("session")
            rounds.append(-1 if r is None else r)
            sessions.append(-1 if s is None else session_ids.setdefault((type(s).__name__, s), len(session_ids)))
            prompt += len(ids)
            total += len(ids) + len(out)
            largest = max(largest, len(ids) + len(out))
            c = rec.get("cached_tokens")
            if c is None:
                served_all = False
            else:
                served["cached_tokens"] += c
                for k in TIERS:
                    served[k] += rec.get(k) or 0
    N = len(offsets)
    if not timed:  # one after another, in the file's order
        arrival = array("d", (2.0 * i for i in range(N)))
        finish = array("d", (2.0 * i + 1 for i in range(N)))
        closes = []
    order = sorted(range(N), key=arrival.__getitem__)  # stable: the file's order among equal times
    offsets, lines, arrival, finish, rounds, sessions = (
        array(a.typecode, (a[i] for i in order)) for a in (offsets, lines, arrival, finish, rounds, sessions))
    del order
    turns = array("q", bytes(8 * len(session_ids)))
    for i in range(N):  # a round is the log's own, else the turn within the session
        if rounds[i] < 0 and sessions[i] >= 0:
            turns[sessions[i]] += 1
            rounds[i] = turns[sessions[i]]
    reqs = Requests(source, offsets, lines, arrival, finish, rounds, vocab if isinstance(vocab, int) else None, spool)
    return Traffic(reqs, sorted(closes, key=lambda c: c[0]), settings, skipped, not_finished, settings_line,
                   prompt, total, largest, served if served_all else None)


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
    windows: str = "-"      # the window retention in effect: spare, windows, or - (no window layers)

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
    from ..config import EngineConfig   # the settings of a tier this configuration turns off do not apply
    return EngineConfig.only_in_effect(kw, store=config.get("storage") == "on")


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
    res.windows = "spare" if eng.cache.spare_windows else "windows" if eng.cache.windowed else "-"
    reqs = traffic.requests
    N = len(reqs)
    arrival = reqs.arrival
    closes = traffic.closes if sessions else []
    by_finish = sorted(range(N), key=reqs.finish.__getitem__)
    finishes = array("d", (reqs.finish[i] for i in by_finish))  # ascending
    rank = array("q", bytes(8 * N))  # request -> its place in finish order
    for place, i in enumerate(by_finish):
        rank[i] = place
    del by_finish
    done = bytearray(N)  # by place in finish order
    state = [0, 0, 0]  # finish places settled (all done before it), next request, next close
    live: dict = {}  # rid -> (request number, Logged)

    def finished(x: int) -> None:
        done[rank[x]] = 1
        while state[0] < N and done[state[0]]:
            state[0] += 1

    def release(get) -> None:
        """Submit what the log says could have arrived by now, in arrival order: an
        item at time t once every request that finished before t has finished here (a
        close at the same instant as an arrival goes first)."""
        while True:
            ri, ci = state[1], state[2]
            close = ci < len(closes) and (ri >= N or closes[ci][0] <= arrival[ri])
            if not close and ri >= N:
                return
            t = closes[ci][0] if close else arrival[ri]
            if bisect.bisect_left(finishes, t) > state[0]:
                return
            if close:
                state[2] += 1
                eng.close_session(*closes[ci][1:])
                continue
            state[1] += 1
            r = get(ri)
            req = eng.replay(r.input_ids, r.output_ids, session_id=r.session if sessions else None, salt=r.salt,
                             priority=r.priority, prompt_logprobs_from=r.prompt_logprobs_from)
            live[req.rid] = (ri, r)
            eng.submit(req)
            if req.done:  # refused at once (it cannot fit these pools)
                _count(res, r, req)
                finished(live.pop(req.rid)[0])

    with reqs.reader(eng.model.vocab_size) as get:
        while True:
            head = state[1] + state[2]
            release(get)
            if not (eng.waiting or eng.running or eng.prefetching):
                if state[1] == N and state[2] == len(closes):
                    break
                if state[1] + state[2] == head:  # cannot happen: what the head waits for arrived before it
                    raise RuntimeError("simulate: the replay is stuck: a request waits for one that never ran")
                continue  # what was refused at once let more arrive
            if eng.storage is not None:
                for _, fut, _ in list(eng.storage.prefetching):  # L3 answers at once
                    fut.exception()
            for req in eng.step():
                x, r = live.pop(req.rid)
                _count(res, r, req)
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
    return replay_model(traffic.settings, model_path, model_preset, dtype)


def replay_model(s: dict, model_path: str | None, model_preset: str | None, dtype: str | None):
    """As load_replay_model, from a start line's settings (checked: log_records)."""
    from ..config import DTYPES
    from ..engine.replay import ReplayModel
    from ..model import load_model
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
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
        elif axis in ("radix_eviction_policy", "swa_retention"):
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
    head = (f"{'page':>5}{'L1 tokens':>11}{'L2':>9}{'L3':>5}{'policy':>9}{'windows':>8}{'sessions':>9}{'batch':>6}"
            f"{'hit rate':>9}{'device':>8}{'host':>7}{'storage':>8}{'preempt':>8}{'req/s':>8}")
    print(head, file=out)
    for r in results:
        c, rt = r.config, r.rates
        l2, l3 = _tier(c)
        print(f"{c.get('page_size'):>5}{c.get('max_total_tokens'):>11,}{l2:>9}{l3:>5}"
              f"{c.get('radix_eviction_policy'):>9}{r.windows:>8}{c.get('sessions'):>9}"
              f"{c.get('max_running_requests'):>6}"
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
    from ..config import EngineConfig
    out = sys.stdout
    bad = BadLines("simulate", a.log, a.skip_bad_lines)
    models: list = []

    def vocab(settings: dict, line: int | None) -> int:  # the replay's model: ids are checked against it
        try:
            models.append(replay_model(settings, a.model_path, a.model_preset, a.dtype))
        except (ValueError, OSError) as e:
            if line is None or a.model_path is not None or a.model_preset is not None:
                raise  # a flag's
            raise BadRecord(line, "settings", f"no model to replay: {getattr(e, 'strerror', None) or e}") from None
        return models[-1].vocab_size
    try:
        axes = {axis: _values(axis, getattr(a, axis)) for axis, _, _ in AXES if getattr(a, axis) is not None}
        if a.target is not None and not 0 < a.target <= 1:
            raise ValueError(f"--target must be a hit rate in (0, 1], got {a.target}")
        traffic = read_log(a.log, vocab, bad)
    except BadRecord as e:
        print(bad.message(e), file=sys.stderr)
        return 2
    except OSError as e:
        print(f"uniradix simulate: {a.log}: {e.strerror or e}", file=sys.stderr)
        return 2
    except (ValueError, ImportError) as e:
        print(f"uniradix simulate: {e}", file=sys.stderr)
        return 2
    if bad.summary():
        print(f"uniradix simulate: {a.log}: {bad.summary()}", file=sys.stderr)
    if not traffic.requests:
        print(f"uniradix simulate: {a.log}: no request with token ids to replay ({traffic.skipped} request "
              f"line(s) without them); log them with `uniradix serve --request-log PATH --log-token-ids`",
              file=sys.stderr)
        return 1
    model = models[-1]
    base = server_config(traffic)
    try:  # the server's own settings, then every configuration, checked before the first replay
        EngineConfig.of(**engine_settings(base))
    except (ValueError, TypeError) as e:
        where = f" line {traffic.settings_line}" if traffic.settings_line else ""
        print(f"uniradix simulate: {a.log}{where}: settings: {e}", file=sys.stderr)
        return 2
    try:
        configs = grid(base, axes)
        for c in configs:
            EngineConfig.of(**engine_settings(c))
    except (ValueError, TypeError) as e:
        print(f"uniradix simulate: {e}", file=sys.stderr)
        return 2
    n = len(traffic.requests)
    print(f"{n:,} requests ({traffic.prompt_tokens:,} prompt tokens) from {a.log}; model {model.inner.name}, "
          f"components {', '.join(s.name for s in model.states().specs)}", file=out)
    if traffic.not_finished or traffic.skipped:
        print(f"not replayed: {traffic.not_finished} failed or aborted request(s), {traffic.skipped} request "
              f"line(s) without token ids", file=out)
    served = traffic.served
    if served is not None:
        print(f"as served: hit rate {served['cached_tokens']:.1%} (device {served.get('cached_device', 0):.1%}, "
              f"host {served.get('cached_host', 0):.1%}, storage {served.get('cached_storage', 0):.1%})", file=out)
    print(file=out)
    # what is alive now (the model, torch's modules) lives until the process ends: frozen,
    # the collector stops scanning it again and again, which was a third of a replay's time
    gc.freeze()
    try:
        results = [replay(traffic, model, c) for c in configs]
        print_results(results, out, a.by_round)
        if a.target is not None:
            print(file=out)
            _targets(traffic, model, configs, a.target, out)
    except BadRecord as e:  # a line read back is not what it was (the log changed under the replay)
        print(bad.message(e), file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # an engine these settings cannot build
        print(f"uniradix simulate: {e}", file=sys.stderr)
        return 2
    return 0


def _targets(traffic: Traffic, model, configs: list[dict], target: float, out) -> None:
    """Per configuration apart from its sizes: the smallest L1 alone that reaches the
    target, then, for each L1 of the grid that has an L2, the smallest L2 over it."""
    total, largest = traffic.total_tokens, traffic.largest
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
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="pass over a line that is not a valid record (each said on stderr) instead of stopping "
                        "at it with exit status 2")
