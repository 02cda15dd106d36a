"""Session-aware eviction against plain LRU: agent-like sessions on the reference
engine, at several batch sizes, with the device cache alone and with the host tier
under it, in one run.

    pip install -e ".[plots]"   # matplotlib, for the PNG
    python benchmarks/session_eviction.py --plot docs/session_eviction.png [--repeats 2]

The workload: every session opens with one long system prompt (--system-tokens, the
agent's instructions and tool definitions); --live-sessions are in flight at a time; each
turn appends a tool result or user message (--message-tokens) to the whole history and
generates a short reply (--reply-tokens, greedy); then the session thinks (its tool
runs) for --think-steps engine steps before its next turn arrives. A session that has
had its turns (--turns) ends and a new one starts, until --sessions have run. Every
draw is made per session up front from --seed and the think clock counts engine steps,
not seconds, so every cell serves exactly the same conversations: the run checks that a
digest of every prompt and reply agrees. The device pools (--max-total-tokens) hold
about the live sessions' mean working set but not its peaks, nor the histories of
sessions that have ended; the recurrent state slots are fixed (--max-mamba-cache-size),
not grown with the batch as the engine's default is.

Grid: batch sizes (--batch-sizes, the engine's --max-running-requests) x eviction x tiers.
LRU: the requests carry no session id and eviction is the default LRU. session: each
request carries its session's id, so a finished turn leaves a reference on what the next
turn will reuse (every component: the full KV along the path, the window, the recurrent
checkpoint), referenced slots are evicted last, and a session that ends is closed, which
drops its references. L1: the device pools alone; L1+L2: host pools --hicache-ratio
times the device's under them (write-through).

Per batch size and tiers, LRU and session side by side: the device hit rate (prompt
tokens reused from the device tier / prompt tokens, summed over the run) and the gain in
points; the total hit rate (device and host); prefill tokens computed; mean and p90 TTFT
(a turn's arrival to its first token: queueing included) and the mean TTFT ratio session
/ LRU; and the requests waiting per step (LRU's cell; the session cell's is about the
same), which says how far the batch limit binds.

Timings drift on a shared machine, so the cells are interleaved: each of the --repeats
passes runs every cell once, starting at a different cell (every other pass backwards),
and TTFTs are medians over the passes. Hit rates and computed tokens do not depend on
timing: the run says whether they were identical in every pass. --plot writes a PNG
(device hit rate and mean TTFT against batch size; skipped, with how to install
matplotlib, when it is missing); the last line is one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from uniradix.engine import Engine, Request, SamplingParams
from uniradix.model import load_model
from uniradix.threads import apply_threads

EVICTIONS = ("LRU", "session")
TIERS = ("L1", "L1+L2")


# ---------------------------------------------------------------------------- the workload
@dataclass(frozen=True)
class Turn:
    """What a turn appends to the history, how many tokens it generates, and how many
    engine steps pass between the previous turn's end (or the session's start) and its
    arrival."""

    new: tuple[int, ...]
    reply: int
    think: int


@dataclass(frozen=True)
class Conversation:
    name: str
    turns: tuple[Turn, ...]


def span(text: str) -> tuple[int, int]:
    """'LO,HI' -> (LO, HI), inclusive."""
    lo, hi = (int(x) for x in text.split(","))
    if not 0 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want LO,HI with 0 <= LO <= HI, got {text!r}")
    return lo, hi


def draw_workload(a, vocab: int) -> tuple[list[int], list[Conversation]]:
    """The system prompt and every session, drawn up front from --seed."""
    rng = random.Random(a.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(n))

    system = list(tokens(a.system_tokens))
    convs = []
    for i in range(a.sessions):
        turns = tuple(Turn(tokens(rng.randint(*a.message_tokens)), rng.randint(*a.reply_tokens),
                           rng.randint(*a.think_steps))
                      for _ in range(rng.randint(*a.turns)))
        convs.append(Conversation(f"session-{i}", turns))
    return system, convs


# ---------------------------------------------------------------------------- the driver
@dataclass
class Live:
    """A session in flight: its conversation, its history so far, its next turn."""

    conv: Conversation
    history: list[int]
    turn: int = 0


@dataclass
class Served:
    """What one cell served: each turn's request by (session, turn), and per engine step
    the requests waiting and running and the live sessions' tokens (the system prompt
    once, each live session's own history), summed over the steps."""

    turns: dict
    steps: int = 0
    waiting: int = 0
    running: int = 0
    live_tokens: int = 0
    live_tokens_max: int = 0


class Driver:
    """Drives the sessions through an engine, step by step: `live` at a time, each turn
    arriving its think time after the previous one ended; a session that has had its
    turns ends (closed, with `sessions`) and the next one starts. Requests carry session
    ids only with `sessions`. The clock is the engine's step count, so what arrives when
    does not depend on how fast the steps run."""

    def __init__(self, engine: Engine, system: list[int], convs: list[Conversation], live: int,
                 sessions: bool) -> None:
        self.engine, self.system, self.sessions = engine, system, sessions
        self.queue = iter(convs)
        self.arrivals: list = []  # (step due, order, Live)
        self.order = itertools.count()
        self.in_flight: dict[int, Live] = {}
        self.own = 0  # the live sessions' own tokens
        self.step = 0
        self.out = Served({})
        for _ in range(live):
            self.start_next()

    def run(self) -> Served:
        while self.arrivals or self.in_flight:
            if not self.in_flight:  # nothing to run: the clock jumps to the next arrival
                self.step = max(self.step, self.arrivals[0][0])
            self.submit_due()
            done = self.engine.step()
            self.step += 1  # what finished in a step is thought about from the next one on
            for req in done:
                self.finish(req)
            self.tally()
        return self.out

    def start_next(self) -> None:
        conv = next(self.queue, None)
        if conv is not None:
            self.arrive_later(Live(conv, list(self.system)))

    def arrive_later(self, s: Live) -> None:
        heapq.heappush(self.arrivals, (self.step + s.conv.turns[s.turn].think, next(self.order), s))

    def submit_due(self) -> None:
        while self.arrivals and self.arrivals[0][0] <= self.step:
            s = heapq.heappop(self.arrivals)[2]
            turn = s.conv.turns[s.turn]
            req = Request(input_ids=s.history + list(turn.new), sampling=SamplingParams(max_new_tokens=turn.reply),
                          session_id=s.conv.name if self.sessions else None)
            self.in_flight[req.rid] = s
            self.engine.submit(req)
            if req.done:  # refused at once (it could never fit): no step will return it
                self.finish(req)

    def finish(self, req: Request) -> None:
        s = self.in_flight.pop(req.rid)
        self.out.turns[s.conv.name, s.turn] = req
        self.own += len(req.input_ids) + len(req.output_ids) - len(s.history)
        s.history = req.input_ids + req.output_ids
        s.turn += 1
        if s.turn < len(s.conv.turns):
            self.arrive_later(s)
            return
        self.own -= len(s.history) - len(self.system)
        if self.sessions:
            self.engine.close_session(s.conv.name)
        self.start_next()

    def tally(self) -> None:
        out, live = self.out, len(self.system) + self.own
        out.steps += 1
        out.waiting += len(self.engine.waiting)
        out.running += len(self.engine.running)
        out.live_tokens += live
        out.live_tokens_max = max(out.live_tokens_max, live)


# ---------------------------------------------------------------------------- one cell
@dataclass(frozen=True)
class Cell:
    batch: int
    tiers: str
    eviction: str

    @property
    def name(self) -> str:
        return f"batch {self.batch}, {self.tiers}, {self.eviction}"


def run_cell(cell: Cell, model, system: list[int], convs: list[Conversation], a) -> dict:
    """One fresh engine serves the whole workload; its figures."""
    host = dict(enable_hierarchical_cache=True, hicache_ratio=a.hicache_ratio) if cell.tiers == "L1+L2" else {}
    eng = Engine(model, page_size=a.page_size, max_total_tokens=a.max_total_tokens,
                 max_running_requests=cell.batch, max_mamba_cache_size=a.max_mamba_cache_size, **host)
    try:
        t0 = time.perf_counter()
        served = Driver(eng, system, convs, a.live_sessions, cell.eviction == "session").run()
        wall = time.perf_counter() - t0
        stats = eng.stats()
    finally:
        eng.close()
    return figures(served, stats, wall)


def figures(served: Served, stats: dict, wall: float) -> dict:
    reqs = [served.turns[k] for k in sorted(served.turns)]
    m = [r.metrics for r in reqs if r.status == "finished"]
    prompt = sum(x.prompt_tokens for x in m)
    device = sum(x.cached_tokens - x.host_tokens - x.storage_tokens for x in m)
    host = sum(x.host_tokens for x in m)
    ttfts = sorted(x.ttft for x in m)
    return {"turns": len(reqs), "errors": len(reqs) - len(m), "prompt_tokens": prompt, "device_tokens": device,
            "host_tokens": host, "computed_tokens": sum(x.computed_tokens for x in m),
            "device_hit_rate": device / prompt if prompt else None,
            "total_hit_rate": (device + host) / prompt if prompt else None,
            "ttft_mean_ms": 1e3 * statistics.fmean(ttfts) if ttfts else None,
            "ttft_p90_ms": 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
            "preemptions": stats["preemptions"], "steps": served.steps,
            "mean_waiting": served.waiting / served.steps, "mean_running": served.running / served.steps,
            "mean_live_tokens": served.live_tokens / served.steps, "max_live_tokens": served.live_tokens_max,
            "evicted": {name: c["evicted"] for name, c in stats["cache"]["components"].items()},
            "conversations": digest(reqs), "wall_s": wall}


def digest(reqs: list[Request]) -> str:
    """What was said: every turn's prompt and reply, in order (identical in every cell
    when reuse is exact)."""
    h = hashlib.sha256()
    for r in reqs:
        h.update(repr((r.input_ids, r.output_ids)).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- the report
def median(values):
    """Median of the figures there are; None if none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, spec: str, width: int = 0) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


#: what does not depend on timing: the same in every pass
COUNTS = ("prompt_tokens", "device_tokens", "host_tokens", "computed_tokens", "errors", "conversations")


def summarize(passes: list[dict]) -> dict:
    """One cell over the passes: the first pass's counts (the run checks they agree) and
    the median TTFTs, with each pass's."""
    s = {k: v for k, v in passes[0].items() if k not in ("ttft_mean_ms", "ttft_p90_ms", "wall_s")}
    for k in ("ttft_mean_ms", "ttft_p90_ms", "wall_s"):
        s[k] = median(p[k] for p in passes)
        s[k + "_each"] = [p[k] for p in passes]
    s["identical_passes"] = all(all(p[k] == passes[0][k] for k in COUNTS) for p in passes[1:])
    return s


def print_table(cells: dict, batches: list[int]) -> None:
    print(f"{'batch':>5} {'tiers':<6} | {'device hit LRU':>14} {'session':>8} {'gain':>8} | "
          f"{'total hit LRU':>13} {'session':>8} | {'computed LRU':>12} {'session':>8} | "
          f"{'TTFT LRU':>10} {'session':>10} {'ratio':>5} | {'p90 LRU':>10} {'session':>10} | "
          f"{'queue':>5}")
    for b in batches:
        for t in TIERS:
            lru, ses = cells[Cell(b, t, "LRU")], cells[Cell(b, t, "session")]
            gain = 100 * (ses["device_hit_rate"] - lru["device_hit_rate"]) if lru["turns"] > lru["errors"] else None
            ratio = ses["ttft_mean_ms"] / lru["ttft_mean_ms"] if lru["ttft_mean_ms"] else None
            print(f"{b:>5} {t:<6} | {fmt(lru['device_hit_rate'], '.1%', 14)} {fmt(ses['device_hit_rate'], '.1%', 8)} "
                  f"{'-' if gain is None else f'{gain:+.1f}':>5} pt | {fmt(lru['total_hit_rate'], '.1%', 13)} {fmt(ses['total_hit_rate'], '.1%', 8)} | "
                  f"{lru['computed_tokens']:>12,} {ses['computed_tokens']:>8,} | "
                  f"{fmt(lru['ttft_mean_ms'], ',.0f', 7)} ms {fmt(ses['ttft_mean_ms'], ',.0f', 7)} ms "
                  f"{fmt(ratio, '.2f', 5)} | {fmt(lru['ttft_p90_ms'], ',.0f', 7)} ms {fmt(ses['ttft_p90_ms'], ',.0f', 7)} ms | "
                  f"{lru['mean_waiting']:>5.1f}")


def plot(cells: dict, batches: list[int], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for t, color in zip(TIERS, ("tab:blue", "tab:orange")):
        for ev, style in zip(EVICTIONS, ("--", "-")):
            rows = [cells[Cell(b, t, ev)] for b in batches]
            kw = {"marker": "o", "linestyle": style, "color": color, "label": f"{t}, {ev}"}
            ax1.plot(batches, [100 * r["device_hit_rate"] for r in rows], **kw)
            ax2.plot(batches, [r["ttft_mean_ms"] for r in rows], **kw)
    ax1.set(ylabel="device hit rate (%)", title="prompt tokens reused from the device tier")
    ax2.set(ylabel="mean TTFT (ms, log scale)", title="mean TTFT, queueing included (median of passes)")
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_xlabel("batch size (--max-running-requests)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def check_same_work(cells: dict) -> list[str]:
    """Lines saying where cells served different conversations (none when all agree)."""
    first = next(iter(cells.values()))
    return [f"{c.name}: {s['turns']} turns, {s['prompt_tokens']} prompt tokens, conversations {s['conversations']} "
            f"(first cell: {first['turns']}, {first['prompt_tokens']}, {first['conversations']})"
            for c, s in cells.items()
            if (s["turns"], s["prompt_tokens"], s["conversations"])
            != (first["turns"], first["prompt_tokens"], first["conversations"])]


def pass_order(grid: list[Cell], k: int, repeats: int) -> list[Cell]:
    """Pass k's order: each pass starts at a different cell, and every other pass runs
    backwards, so that neither eviction always runs first within a pair."""
    r = k * len(grid) // repeats
    order = grid[r:] + grid[:r]
    return order[::-1] if k % 2 else order


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=72, help="sessions in all")
    p.add_argument("--live-sessions", type=int, default=24, help="sessions in flight at once")
    p.add_argument("--turns", type=span, default=(3, 8), help="turns per session, LO,HI")
    p.add_argument("--system-tokens", type=int, default=1024, help="the system prompt every session opens with")
    p.add_argument("--message-tokens", type=span, default=(32, 128),
                   help="tokens a turn appends (a tool result or user message), LO,HI")
    p.add_argument("--reply-tokens", type=span, default=(4, 12), help="tokens a turn generates, LO,HI")
    p.add_argument("--think-steps", type=span, default=(0, 50),
                   help="engine steps between a turn's end and the next turn's arrival, LO,HI")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-sizes", default="1,4,16", help="--max-running-requests values, comma-separated")
    p.add_argument("--model-preset", default="tiny-hybrid")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=6144, help="the device (L1) pools")
    p.add_argument("--max-mamba-cache-size", type=int, default=128,
                   help="recurrent state slots, the same at every batch size")
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="the host (L2) pools, times L1")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--repeats", type=int, default=2,
                   help="passes over the cells, interleaved; TTFTs are medians over them")
    p.add_argument("--plot", default="", help="PNG path ('' for none)")
    a = p.parse_args()
    batches = [int(b) for b in a.batch_sizes.split(",")]
    if a.repeats < 1 or a.live_sessions < 1 or a.sessions < 1 or min(batches) < 1:
        p.error("--repeats, --live-sessions, --sessions and the batch sizes must be at least 1")
    apply_threads(a.threads)
    model = load_model(a.model_preset)
    system, convs = draw_workload(a, model.vocab_size)
    turns = [t for c in convs for t in c.turns]
    print(f"{a.model_preset}, {len(convs)} sessions, {a.live_sessions} at a time, {len(turns)} turns: a "
          f"{len(system)}-token system prompt, then per turn {a.message_tokens[0]}-{a.message_tokens[1]} new and "
          f"{a.reply_tokens[0]}-{a.reply_tokens[1]} generated tokens and a think time of "
          f"{a.think_steps[0]}-{a.think_steps[1]} engine steps; device pools (L1) {a.max_total_tokens} tokens, "
          f"host pools (L2) {int(a.max_total_tokens * a.hicache_ratio)}; {a.max_mamba_cache_size} recurrent "
          f"state slots; page size {a.page_size}; {torch.get_num_threads()} torch thread(s); "
          f"{a.repeats} interleaved passes, median TTFTs; load average {os.getloadavg()[0]:.2f}")
    grid = [Cell(b, t, ev) for b in batches for t in TIERS for ev in EVICTIONS]
    runs = {c: [] for c in grid}
    for k in range(a.repeats):
        for cell in pass_order(grid, k, a.repeats):
            print(f"pass {k + 1}/{a.repeats}: {cell.name}", file=sys.stderr, flush=True)
            runs[cell].append(run_cell(cell, model, system, convs, a))
    cells = {c: summarize(runs[c]) for c in grid}
    print_table(cells, batches)
    first = cells[grid[0]]
    differ = check_same_work(cells)
    for line in differ:
        print(f"DIFFERENT WORK: {line}")
    if not differ:
        print(f"every cell served the same {first['turns']} turns ({first['prompt_tokens']:,} prompt tokens; "
              f"conversations {first['conversations']})")
    changed = [c.name for c in grid if not cells[c]["identical_passes"]]
    print(f"hit rates and computed tokens identical in all {a.repeats} passes" if not changed
          else f"counts differ across passes (the table shows pass 1's): {'; '.join(changed)}")
    errors = {c.name: cells[c]["errors"] for c in grid if cells[c]["errors"]}
    if errors:
        print(f"ERRORS (failed turns; they count as unserved): {errors}")
    live = [cells[c]["mean_live_tokens"] for c in grid]
    print(f"live sessions' tokens (the system prompt once and each live session's history), mean over steps "
          f"{min(live):,.0f} to {max(live):,.0f} across cells, at most "
          f"{max(cells[c]['max_live_tokens'] for c in grid):,}; device pools {a.max_total_tokens:,}")
    if a.plot:
        try:
            plot(cells, batches, a.plot, f"{a.model_preset}: {a.live_sessions} live sessions, device pools "
                                         f"{a.max_total_tokens} tokens, medians of {a.repeats}")
            print(f"plot: {a.plot}")
        except ImportError:  # the table above is the result; the PNG is optional
            print('plot skipped: matplotlib is not installed (pip install -e ".[plots]" for the PNG, '
                  "or --plot '' for none)")
    print(json.dumps({"settings": {k: v for k, v in vars(a).items() if k != "plot"},
                      "cells": [dict(batch=c.batch, tiers=c.tiers, eviction=c.eviction, **cells[c]) for c in grid]}))


if __name__ == "__main__":
    main()
