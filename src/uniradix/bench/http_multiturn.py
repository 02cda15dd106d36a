"""`uniradix bench multiturn --url URL`: the multi-turn workload over HTTP, against this
server or any other that speaks SGLang's `/generate` (`--api sglang`) or OpenAI's
completions (`--api openai`: vLLM's, llama.cpp's, SGLang's OpenAI routes), so an
operator can measure a server's hit rate before switching to it.

`--clients` conversations each open with a document of their own (after a preamble
they all share) and add `--new-words` words a round for `--rounds` rounds; each reply
(`--output-tokens` tokens, greedy, streamed) goes back into its conversation. At most
`--max-parallel` requests are in flight; with `--request-rate`, new requests start at
that many a second (Poisson). Per round: the hit rate (cached prompt tokens over prompt
tokens, summed), TTFT mean and p90, and the effective input throughput (prompt tokens,
cached ones included, over the round's wall time). Cached tokens are read from what the
server reports: SGLang's `meta_info.cached_tokens`, OpenAI's
`usage.prompt_tokens_details.cached_tokens`, llama.cpp's `timings.cache_n`; where a
server reports none, the hit rate says "not reported", never 0; where it splits them by
tier (uniradix: `cached_tokens_details`), the split is summed too. `--log` writes one
JSON line per request (for `uniradix hit-rate`), `--plot` a PNG (matplotlib).

Behind SGLang's gateway (smg), `--routing-key` sends each conversation's id as the
gateway's routing key (`X-SMG-Routing-Key`), so a policy that honours it keeps a
conversation on one worker; the gateway routes no `/close_session`, so sessions are
closed on the worker the gateway named (`x-smg-routed-worker-id`) for the last turn."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import http.client

WORDS = ("cache", "prefix", "token", "layer", "window", "state", "page", "tier", "host", "device", "store",
         "session", "round", "reply", "model", "batch", "queue", "memory", "attention", "recurrent")


#: the per-tier split of cached tokens a server may report (uniradix's cached_tokens_details,
#: and its cached_tokens_cross_instance: the part of storage's another instance wrote)
TIERS = ("device", "host", "storage", "cross_instance")


@dataclass
class Result:
    client: int
    round: int
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    tiers: dict | None = None     # cached tokens by tier, where the server says
    worker: str | None = None     # the worker a gateway sent it to, where it says
    ttft: float | None = None
    latency: float = 0.0
    text: str = ""
    error: str | None = None
    start: float = 0.0
    end: float = 0.0


@dataclass
class Conversation:
    text: str
    results: list = field(default_factory=list)
    worker: str | None = None   # where its last turn went, behind a gateway


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _connect(base: str, timeout: float):
    """(a connection to the server at `base`, the path prefix its routes sit under)."""
    u = urllib.parse.urlsplit(base)
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return conn_cls(u.hostname, u.port or (443 if u.scheme == "https" else 80), timeout=timeout), u.path.rstrip("/")


def _post_stream(base, path: str, body: dict, headers: dict, timeout: float, res: Result | None = None):
    """POST a streaming request; yields each server-sent event's data (parsed). An error
    event (a gateway's, when the worker behind it died mid-stream) raises. `res.worker`:
    the worker a gateway says it routed to."""
    c, prefix = _connect(base, timeout)
    try:
        c.request("POST", prefix + path, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
        r = c.getresponse()
        if res is not None:
            res.worker = r.getheader("x-smg-routed-worker-id")
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300].decode(errors='replace')}")
        for line in r:
            line = line.strip()
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                ev = json.loads(data)
                if isinstance(ev, dict) and ev.get("error"):
                    err = ev["error"]
                    raise RuntimeError(f"error event: {err.get('message', err) if isinstance(err, dict) else err}")
                yield ev
    finally:
        c.close()


def one_request(a, conv: Conversation, client: int, rnd: int) -> Result:
    res = Result(client, rnd, start=time.perf_counter())
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    sid = f"bench-{a.seed}-{client}" if a.session_id else None
    if getattr(a, "routing_key", False):
        headers["X-SMG-Routing-Key"] = f"bench-{a.seed}-{client}"
    try:
        if a.api == "sglang":
            body = {"text": conv.text, "stream": True, "rid": f"c{client}-r{rnd}",
                    "sampling_params": {"max_new_tokens": a.output_tokens, "temperature": 0, "ignore_eos": True}}
            if sid:
                body["session_id"] = sid
            for ev in _post_stream(a.url, "/generate", body, headers, a.timeout, res):
                if res.ttft is None and ev.get("text"):
                    res.ttft = time.perf_counter() - res.start
                res.text = ev.get("text", res.text)
                m = ev.get("meta_info") or {}
                res.prompt_tokens = m.get("prompt_tokens", res.prompt_tokens)
                if m.get("cached_tokens") is not None:
                    res.cached_tokens = m["cached_tokens"]
                if isinstance(m.get("cached_tokens_details"), dict):
                    res.tiers = {t: m["cached_tokens_details"].get(t, 0) for t in TIERS[:3]}
                    res.tiers["cross_instance"] = m.get("cached_tokens_cross_instance", 0)
        else:
            body = {"model": a.model, "prompt": conv.text, "max_tokens": a.output_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            if sid:
                body["session_id"] = sid
            for ev in _post_stream(a.url, "/v1/completions", body, headers, a.timeout, res):
                for ch in ev.get("choices") or []:
                    if ch.get("text"):
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - res.start
                        res.text += ch["text"]
                u = ev.get("usage") or {}
                if u.get("prompt_tokens") is not None:
                    res.prompt_tokens = u["prompt_tokens"]
                details = u.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    res.cached_tokens = details["cached_tokens"]
                t = ev.get("timings") or {}
                if t.get("cache_n") is not None:  # llama.cpp's own field
                    res.cached_tokens = t["cache_n"]
    except Exception as e:  # the server's or the network's: counted, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    res.latency = res.end - res.start
    return res


def run(a, out=None, before_round=None) -> list[dict]:
    """The whole workload; returns the per-round summary rows (and prints them).
    `before_round(rnd)` is called as each round starts (a benchmark's hook)."""
    out = out or sys.stdout
    rng = random.Random(a.seed)
    preamble = "You are a helpful assistant. " + _words(rng, a.preamble_words)
    convs = [Conversation(f"{preamble}\nDocument {i}: {_words(rng, a.document_words)}\nQuestion: "
                          f"{_words(rng, a.new_words)}\nAnswer:") for i in range(a.clients)]
    rows, log = [], (open(a.log, "a", encoding="utf-8") if a.log else None)
    bar = None
    if not a.no_progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=a.clients * a.rounds, file=sys.stderr, desc="requests")
        except ImportError:
            bar = None
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=a.max_parallel) as pool:
        for rnd in range(1, a.rounds + 1):
            if before_round is not None:
                before_round(rnd)
            t0 = time.perf_counter()
            futures = []
            for i, conv in enumerate(convs):
                if a.request_rate:
                    time.sleep(rng.expovariate(a.request_rate))
                futures.append(pool.submit(one_request, a, conv, i, rnd))
            results = [f.result() for f in futures]
            wall = time.perf_counter() - t0
            for i, (conv, res) in enumerate(zip(convs, results)):
                conv.results.append(res)
                conv.worker = res.worker or conv.worker
                conv.text += res.text + f"\nQuestion: {_words(rng, a.new_words)}\nAnswer:"
                if log is not None:
                    with lock:
                        log.write(json.dumps({"round": rnd, "client": i, "time": round(time.time(), 3),
                                              "session": f"client-{i}", "prompt_tokens": res.prompt_tokens,
                                              "cached_tokens": res.cached_tokens,
                                              **({f"cached_{t}": n for t, n in res.tiers.items()} if res.tiers
                                                 else {}), "ttft": res.ttft,
                                              "latency": res.latency, "error": res.error}) + "\n")
            if bar is not None:
                bar.update(len(results))
            rows.append(_summary(rnd, results, wall))
    if log is not None:
        log.close()
    if bar is not None:
        bar.close()
    if a.session_id and a.api == "sglang":
        for i, conv in enumerate(convs):  # the server may keep what a session references: let it go
            try:
                _close_session(a, f"bench-{a.seed}-{i}", conv.worker)
            except Exception:
                pass
    _print(rows, a, out)
    if a.plot:
        _plot(rows, a.plot, out)
    return rows


def _close_session(a, sid: str, worker: str | None = None) -> None:
    """On the server, or behind a gateway on the worker its last turn went to."""
    c, prefix = _connect(worker or a.url, a.timeout)
    try:
        headers = {"Content-Type": "application/json"}
        if a.api_key:
            headers["Authorization"] = f"Bearer {a.api_key}"
        c.request("POST", prefix + "/close_session", json.dumps({"session_id": sid}), headers)
        c.getresponse().read()
    finally:
        c.close()


def _summary(rnd: int, results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in reported) if reported else None
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
    split = [r.tiers for r in ok if r.tiers is not None]
    return {"round": rnd, "requests": len(results), "errors": len(results) - len(ok), "prompt_tokens": prompt,
            "cached_tokens": cached,
            "cached_by_tier": {t: sum(x[t] for x in split) for t in TIERS} if split else None,
            "by_worker": dict(Counter(r.worker for r in results if r.worker)) or None,
            "hit_rate": None if cached is None or not prompt else cached / prompt,
            "ttft_mean": statistics.fmean(ttfts) if ttfts else None,
            "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else None,
            "input_tok_s": prompt / wall if wall > 0 else None,
            "first_error": next((r.error for r in results if r.error), None)}


def _print(rows: list[dict], a, out) -> None:
    print(f"uniradix bench multiturn: {a.url} ({a.api}), {a.clients} clients x {a.rounds} rounds, "
          f"{a.new_words} new words and {a.output_tokens} output tokens a round, session ids "
          f"{'on' if a.session_id else 'off'}", file=out)
    print(f"{'round':>5}{'prompt tok':>12}{'cached tok':>12}{'hit rate':>14}{'TTFT mean s':>13}{'TTFT p90 s':>12}"
          f"{'input tok/s':>13}{'errors':>8}", file=out)
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        hit = "not reported" if r["cached_tokens"] is None else f(r["hit_rate"], ".1%")
        print(f"{r['round']:>5}{r['prompt_tokens']:>12,}{f(r['cached_tokens'], ','):>12}{hit:>14}"
              f"{f(r['ttft_mean'], '.3f'):>13}{f(r['ttft_p90'], '.3f'):>12}{f(r['input_tok_s'], ',.0f'):>13}"
              f"{r['errors']:>8}", file=out)
    p = sum(r["prompt_tokens"] for r in rows)
    known = [r for r in rows if r["cached_tokens"] is not None]
    c = sum(r["cached_tokens"] for r in known)
    hit = "not reported" if not known else f"{c / p if p else 0:.1%}"
    print(f"  all: {p:,} prompt tokens, hit rate {hit} (cached prefix tokens / prompt tokens, summed)", file=out)
    split = [r["cached_by_tier"] for r in rows if r.get("cached_by_tier")]
    if split and p:
        by = {t: sum(x[t] for x in split) for t in TIERS}
        print(f"  by tier: device {by['device'] / p:.1%}, host {by['host'] / p:.1%}, storage {by['storage'] / p:.1%} "
              f"(from objects another instance wrote: {by['cross_instance'] / p:.1%})", file=out)
    for r in rows:
        if r["first_error"]:
            print(f"  round {r['round']}: {r['errors']} failed, the first: {r['first_error'][:300]}", file=out)
            break


def _plot(rows: list[dict], path: str, out) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  no plot: matplotlib is not installed (pip install 'uniradix[plots]')", file=out)
        return
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    xs = [r["round"] for r in rows]
    ax[0].plot(xs, [100 * (r["hit_rate"] or 0) for r in rows], marker="o")
    ax[0].set(xlabel="round", ylabel="hit rate %", title="hit rate")
    ax[1].plot(xs, [r["ttft_mean"] or 0 for r in rows], marker="o")
    ax[1].set(xlabel="round", ylabel="s", title="TTFT mean")
    fig.tight_layout()
    fig.savefig(path)
    print(f"  plot: {path}", file=out)


def add_args(p) -> None:
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    p.add_argument("--api", choices=("sglang", "openai"), default="sglang",
                   help="SGLang's /generate, or OpenAI's /v1/completions")
    p.add_argument("--model", default="default", help="the model name OpenAI requests carry")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--clients", "--num-clients", type=int, default=8,
                   help="conversations, one per client (SGLang's bench_multiturn.py: --num-clients)")
    p.add_argument("--rounds", "--num-rounds", type=int, default=5,
                   help="turns per conversation (SGLang's bench_multiturn.py: --num-rounds)")
    p.add_argument("--preamble-words", type=int, default=60, help="the preamble every conversation opens with")
    p.add_argument("--document-words", type=int, default=200, help="each conversation's own opening document")
    p.add_argument("--new-words", type=int, default=40, help="words each turn adds")
    p.add_argument("--output-tokens", type=int, default=32, help="tokens per reply (greedy)")
    p.add_argument("--max-parallel", type=int, default=8, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=0.0, help="new requests a second, Poisson (0: all at once)")
    p.add_argument("--session-id", action=argparse.BooleanOptionalAction, default=True,
                   help="send a session id per conversation (--no-session-id: none)")
    p.add_argument("--routing-key", action="store_true",
                   help="behind SGLang's gateway: send each conversation's id as its routing key "
                        "(X-SMG-Routing-Key), which keeps it on one worker under --policy consistent_hashing or "
                        "manual, or with the gateway's --routing-key-override")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--log", default=None, help="append one JSON line per request here (for uniradix hit-rate)")
    p.add_argument("--plot", default=None, help="write a PNG of hit rate and TTFT per round here (needs "
                                                "matplotlib: pip install 'uniradix[plots]')")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(a) -> int:
    for name in ("clients", "rounds", "max_parallel", "output_tokens"):
        if getattr(a, name) < 1:
            print(f"uniradix bench multiturn: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if urllib.parse.urlsplit(a.url).scheme not in ("http", "https") or not urllib.parse.urlsplit(a.url).hostname:
        print(f"uniradix bench multiturn: --url {a.url!r} is not an http(s) URL", file=sys.stderr)
        return 2
    rows = run(a)
    return 1 if any(r["errors"] for r in rows) else 0
