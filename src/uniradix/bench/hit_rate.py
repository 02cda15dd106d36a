"""`uniradix hit-rate LOG`: the hit rate of logged traffic, by round, by hour and by
session: cached prefix tokens over prompt tokens, each summed over the group, never a
mean of per-request ratios (a mean would weigh a 10-token request like a 10,000-token
one). It reads the server's `--request-log`, or any JSON-lines file whose records carry
a prompt-token and a cached-token count (log_records.PROMPT, CACHED) and a `round` or
a `time` (Unix seconds).

Each line is checked as it is read (log_records): a bad one is one line on stderr naming
its line number and field, and the command exits 2, or with `--skip-bad-lines` passes
over it. The records are summed as they come, per group: memory grows with the groups
(rounds, hours, sessions), never with the lines."""
from __future__ import annotations

import sys
import time

from .log_records import (
    CACHED,
    PROMPT,
    REQUEST,
    TIERS,
    BadLines,
    BadRecord,
    first,
    open_log,
    records,
)

#: the groupings --by takes, in the order they print
GROUPINGS = ("round", "hour", "session")


class Sums:
    """One group's sums: requests, prompt tokens, cached tokens, cached tokens by tier
    (`tiers`: whether any of its records said them)."""

    __slots__ = ("cached", "device", "host", "prompt", "requests", "storage", "tiers")  # one per session: small

    def __init__(self) -> None:
        self.requests = self.prompt = self.cached = self.device = self.host = self.storage = 0
        self.tiers = False

    def add(self, p: int, c: int, tiers: tuple) -> None:
        self.requests += 1
        self.prompt += p
        self.cached += c
        d, h, s = tiers
        if d is not None or h is not None or s is not None:
            self.device += d or 0
            self.host += h or 0
            self.storage += s or 0
            self.tiers = True

    def row(self, key) -> tuple:
        """(group, requests, prompt tokens, cached tokens, {tier: cached})."""
        tier = dict(zip(TIERS, (self.device, self.host, self.storage))) if self.tiers else {}
        return key, self.requests, self.prompt, self.cached, tier


class Report:
    """The hit rate aggregated as the records are read: sums per group, never the
    records, so its memory grows with the groups (rounds, hours, sessions), not the
    lines. `by`: the groupings kept (GROUPINGS)."""

    def __init__(self, by=GROUPINGS) -> None:
        self.groups: dict[str, dict] = {b: {} for b in by}
        self.all = Sums()
        self.without = 0  # request lines without a prompt-token and a cached-token count

    def add(self, rec: dict) -> None:
        """A checked request record (log_records.check_request)."""
        _, p = first(rec, PROMPT)
        _, c = first(rec, CACHED)
        if p is None or c is None:
            self.without += 1
            return
        tiers = (rec.get("cached_device"), rec.get("cached_host"), rec.get("cached_storage"))  # TIERS
        self.all.add(p, c, tiers)
        for b, acc in self.groups.items():
            k = _key(b, rec)
            if k is not None:
                sums = acc.get(k)
                if sums is None:
                    sums = acc[k] = Sums()
                sums.add(p, c, tiers)

    def rows(self, b: str) -> list[tuple]:
        """[(group, requests, prompt tokens, cached tokens, {tier: cached})], groups sorted."""
        acc = self.groups.get(b, {})
        show = hour if b == "hour" else (lambda k: k)
        return [acc[k].row(show(k)) for k in sorted(acc)]


def _key(b: str, rec: dict):
    if b == "round":
        return rec.get("round")
    if b == "hour":
        t = rec.get("time")
        return None if t is None else int(t // 3600)
    s = rec.get("session")
    return None if s is None else str(s)


def hour(k: int) -> str:
    """An hour's group (hours since 1970) as it prints, UTC."""
    return time.strftime("%Y-%m-%d %H:00", time.gmtime(k * 3600))


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
    out = sys.stdout
    by = [b.strip() for b in a.by.split(",") if b.strip()]
    unknown = [b for b in by if b not in GROUPINGS]
    if unknown:
        print(f"uniradix hit-rate: --by {','.join(unknown)}: use round, hour or session", file=sys.stderr)
        return 2
    bad = BadLines("hit-rate", a.log, a.skip_bad_lines)
    report = Report(by)
    try:
        with open_log(a.log) as f:
            # ids are checked against the vocabulary of the start line before them, when it says one
            for _, _, kind, rec in records(f, vocab=lambda settings: settings.get("vocab_size"), bad=bad):
                if kind == REQUEST:
                    report.add(rec)
    except OSError as e:
        print(f"uniradix hit-rate: {a.log}: {e.strerror or e}", file=sys.stderr)
        return 2
    except BadRecord as e:
        print(bad.message(e), file=sys.stderr)
        return 2
    if bad.summary():
        print(f"uniradix hit-rate: {a.log}: {bad.summary()}", file=sys.stderr)
    if not report.all.requests:
        print(f"uniradix hit-rate: {a.log}: no record with a prompt-token and a cached-token count "
              f"({report.without} request line(s) without them)", file=sys.stderr)
        return 1
    titles = {"round": "round", "hour": "hour (UTC)", "session": "session"}
    for b in by:
        table(titles[b], report.rows(b), out)
    _, n, p, c, tier = report.all.row("all")
    line = f"all: {n:,} requests, {c:,} of {p:,} prompt tokens cached: hit rate {c / p if p else 0:.1%}"
    if tier:
        line += " (" + ", ".join(f"{t.removeprefix('cached_')} {tier.get(t, 0) / p if p else 0:.1%}" for t in TIERS) + ")"
    print(line, file=out)
    if report.without:
        print(f"{report.without} request line(s) without a prompt-token and a cached-token count", file=out)
    return 0


def add_args(p) -> None:
    p.add_argument("log", help="a JSON-lines file: the server's --request-log, or '-' for standard input")
    p.add_argument("--by", default="round,hour,session",
                   help="groupings to print, any of round, hour, session (default: all; a grouping the records "
                        "carry nothing for is left out)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="pass over a line that is not a valid record (each said on stderr) instead of stopping "
                        "at it with exit status 2")
