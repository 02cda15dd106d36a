"""`GET /dashboard`: a page an operator keeps open beside the server, and the JSON it
reads (`GET /dashboard/data`). Its numbers are /metrics' own: the same snapshot of the
engine, taken on the scheduler thread, turned into series by the same derivation
(ServerMetrics.values), so the page and a Prometheus scrape never disagree. What
Prometheus would keep over time, the hit rate by tier and the queues, the server keeps
here too (`History`, sampled on the scheduler thread), so the page shows the last
minutes the moment it opens, with nothing else running.

The page is one self-contained file (dashboard.html: inline style and script, no
external assets), so it works offline. It carries no data: it is served without the
API key, and its script asks for the key when /dashboard/data answers 401."""
from __future__ import annotations

import logging
import time
from collections import deque
from importlib import resources

from .metrics import TTFT_BUCKETS

log = logging.getLogger("uniradix.server")

#: seconds between two samples of the history, and how many are kept (30 minutes)
SAMPLE_S = 2.0
KEEP = 900

#: the series the history keeps per sample: the counters a hit rate per tier over time
#: is made of, the decode tokens and finished requests (the rates of the last minute),
#: and the queue gauges
HISTORY_SERIES = {
    "prompt": "uniradix_prompt_tokens_total",
    "device": 'uniradix_cached_tokens_total{tier="device"}',
    "host": 'uniradix_cached_tokens_total{tier="host"}',
    "storage": 'uniradix_cached_tokens_total{tier="storage"}',
    "decode": "uniradix_decode_tokens_total",
    "finished": "uniradix_requests_finished_total",
    "running": "uniradix_running_requests",
    "waiting": "uniradix_waiting_requests",
}


class History:
    """Samples of HISTORY_SERIES every `interval` seconds (the scheduler thread calls
    `tick` on each turn of its loop, at least once a second even when idle); the page
    plots the differences between consecutive samples."""

    def __init__(self, metrics, interval: float = SAMPLE_S, keep: int = KEEP) -> None:
        self.metrics = metrics
        self.interval = interval
        self.samples: deque = deque(maxlen=keep)
        self._next = 0.0
        self._failed = False

    def tick(self, snapshot) -> None:
        """On the scheduler thread: a sample when one is due. Never raises (a failure here
        would end the scheduler's loop): the dashboard misses a sample, logged once."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        try:
            self.record(self.metrics.values(snapshot()))
        except Exception:
            if not self._failed:
                log.exception("the dashboard's history missed a sample (logged once)")
            self._failed = True

    def record(self, values: dict) -> None:
        """`t`: wall-clock time, to show; `m`: monotonic seconds, for rates and windows."""
        self.samples.append({"t": round(time.time(), 3), "m": round(time.monotonic(), 3),
                             **{k: values[s] for k, s in HISTORY_SERIES.items()}})


def quantiles(values: dict, bucket: str = TTFT_BUCKETS, qs=(0.5, 0.9, 0.99)) -> dict[str, float | None]:
    """Percentiles of a histogram from its cumulative buckets in `values` (as Prometheus'
    histogram_quantile: linear within the bucket the rank falls in; past the last finite
    bound, that bound); None while it has no observations."""
    pre = bucket + '{le="'
    bounds = sorted((float(k[len(pre):-2]), n) for k, n in values.items() if k.startswith(pre))
    total = bounds[-1][1] if bounds else 0
    out = {}
    for q in qs:
        name = f"p{round(100 * q)}"
        if not total:
            out[name] = None
            continue
        rank, lo, below = q * total, 0.0, 0.0
        for le, n in bounds:
            if n >= rank:
                out[name] = lo if le == float("inf") else lo + (le - lo) * (rank - below) / max(n - below, 1e-12)
                break
            lo, below = le, n
    return out


def dashboard_data(values: dict, history: History, engine, info: dict) -> dict:
    """What the page shows: `metrics` (this moment's series, as /metrics keys them), the
    components (name, unit, whether a slot is a checkpoint), which tiers exist, the
    history, and the server's `info` (model, version, start time)."""
    comps = [{"name": c.name, "unit": c.unit, "checkpoint": bool(c.checkpoint)}
             for c in engine.cache.tree.components]
    storage = engine.storage
    return {"time": round(time.time(), 3), "info": info, "components": comps,
            "tiers": {"host": engine.cache.host is not None, "storage": storage is not None,
                      "storage_backend": None if storage is None else type(storage.backend).__name__,
                      "write_policy": engine.config.host.hicache_write_policy},
            "sample_s": history.interval, "history": list(history.samples), "metrics": values,
            "ttft": quantiles(values)}


def page() -> str:
    return resources.files(__package__).joinpath("dashboard.html").read_text(encoding="utf-8")
