"""`uniradix hit-rate LOG`: the hit rate of logged traffic, by round, by hour and by
session: cached prefix tokens over prompt tokens, each summed over the group, never a
mean of per-request ratios (a mean would weigh a 10-token request like a 10,000-token
one). It reads the server's `--request-log`, or any JSON-lines file whose records carry
a prompt-token and a cached-token count (the names below) and a `round` or a `time`
(Unix seconds)."""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict

#: accepted field names, first found wins: the server's own, then the usual others
PROMPT = ("prompt_tokens", "prompt_tok", "input_tokens", "num_prompt_tokens")
CACHED = ("cached_tokens", "cached_tok", "cached_prompt_tokens", "prefix_hit_tokens")
TIERS = ("cached_device", "cached_host", "cached_storage")


def _first(rec: dict, names):
    for n in names:
        v = rec.get(n)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


def json_lines(path: str):
    """Each non-empty line of a JSON-lines file ('-': standard input), parsed: a value,
    or None for a line that is not JSON."""
    with (sys.stdin if path == "-" else open(path, encoding="utf-8")) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except ValueError:
                yield None


def read(path: str) -> tuple[list[dict], int]:
    """(records with prompt and cached counts, lines skipped: not JSON or without them)."""
    out, skipped = [], 0
    for rec in json_lines(path):
        if isinstance(rec, dict) and "event" in rec:
            continue  # the server's start and close_session lines: not requests
        p, c = (_first(rec, PROMPT), _first(rec, CACHED)) if isinstance(rec, dict) else (None, None)
        if p is None or c is None or p < 0 or c < 0 or c > p:
            skipped += 1
            continue
        out.append({**rec, "_prompt": p, "_cached": c})
    return out, skipped


def group(records: list[dict], key) -> list[tuple]:
    """[(group, requests, prompt tokens, cached tokens, {tier: cached})], groups sorted."""
    acc: dict = defaultdict(lambda: [0, 0, 0, defaultdict(int)])
    for r in records:
        k = key(r)
        if k is None:
            continue
        a = acc[k]
        a[0] += 1
        a[1] += r["_prompt"]
        a[2] += r["_cached"]
        for t in TIERS:
            if isinstance(r.get(t), (int, float)):
                a[3][t] += r[t]
    return [(k, *acc[k][:3], dict(acc[k][3])) for k in sorted(acc, key=lambda x: (str(type(x)), x))]


def hour(r: dict):
    t = r.get("time")
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return None
    return time.strftime("%Y-%m-%d %H:00", time.gmtime(t))


def table(title: str, rows: list[tuple], out) -> None:
    if not rows:
        return
    tiers = any(r[4] for r in rows)
    head = f"{title:<20}{'requests':>9}{'prompt tok':>12}{'cached tok':>12}{'hit rate':>9}"
    if tiers:
        head += f"{'device':>9}{'host':>9}{'storage':>9}"
    print(head, file=out)
    for k, n, p, c, tier in rows:
        line = f"{str(k)[:20]:<20}{n:>9,}{p:>12,}{c:>12,}{(c / p if p else 0):>9.1%}"
        if tiers:
            line += "".join(f"{(tier.get(t, 0) / p if p else 0):>9.1%}" for t in TIERS)
        print(line, file=out)
    print(file=out)


def main(a) -> int:
    try:
        records, skipped = read(a.log)
    except OSError as e:
        print(f"uniradix hit-rate: {a.log}: {e.strerror or e}", file=sys.stderr)
        return 2
    if not records:
        print(f"uniradix hit-rate: {a.log}: no record with a prompt-token and a cached-token count "
              f"({skipped} line(s) skipped)", file=sys.stderr)
        return 1
    out = sys.stdout
    by = [b.strip() for b in a.by.split(",") if b.strip()]
    bad = [b for b in by if b not in ("round", "hour", "session")]
    if bad:
        print(f"uniradix hit-rate: --by {','.join(bad)}: use round, hour or session", file=sys.stderr)
        return 2
    for b in by:
        if b == "round":
            table("round", group(records, lambda r: r.get("round") if isinstance(r.get("round"), int) else None), out)
        elif b == "hour":
            table("hour (UTC)", group(records, hour), out)
        elif b == "session":
            table("session", group(records, lambda r: None if r.get("session") is None else str(r["session"])), out)
    _, n, p, c, tier = group(records, lambda r: "all")[0]
    line = f"all: {n:,} requests, {c:,} of {p:,} prompt tokens cached: hit rate {c / p if p else 0:.1%}"
    if tier:
        line += " (" + ", ".join(f"{t.removeprefix('cached_')} {tier.get(t, 0) / p if p else 0:.1%}" for t in TIERS) + ")"
    print(line, file=out)
    if skipped:
        print(f"{skipped} line(s) skipped: not JSON, or without the counts", file=out)
    return 0


def add_args(p) -> None:
    p.add_argument("log", help="a JSON-lines file: the server's --request-log, or '-' for standard input")
    p.add_argument("--by", default="round,hour,session",
                   help="groupings to print, any of round, hour, session (default: all; a grouping the records "
                        "carry nothing for is left out)")
