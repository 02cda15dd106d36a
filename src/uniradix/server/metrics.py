"""`/metrics`: the engine's own counters in Prometheus' text format, so that a hit rate
is a ratio of two counters (`uniradix_cached_tokens_total` over
`uniradix_prompt_tokens_total`, by tier), beside latency histograms the server observes.

The counters and gauges are read from one snapshot of `Engine.stats()` taken on the
scheduler thread at scrape time: what /metrics says is what the engine counted, never a
second count, and a gauge never runs ahead of the counters beside it. What happens to
the HTTP connections themselves (closed for slowness, refused at the limit, clients
that left mid-body) is the server's own count, kept here as it happens."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: why the server closes a connection (connections.py, and the app's body reader)
CLOSE_REASONS = ("header_timeout", "body_timeout", "evicted", "write_timeout", "shutdown", "bad_request")

#: the histogram whose buckets `values` keeps (the dashboard's TTFT percentiles)
TTFT_BUCKETS = "uniradix_time_to_first_token_seconds_bucket"
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: engine counter -> (metric name, help)
ENGINE_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "prompt tokens of the requests admitted"),
    "prefill_tokens": ("prefill_tokens", "prompt tokens computed (not reused)"),
    "decode_tokens": ("decode_tokens", "tokens computed while decoding"),
    "finished": ("requests_finished", "requests finished"),
    "errors": ("requests_failed", "requests that ended in an error"),
    "aborted": ("requests_aborted", "requests aborted (the client went away, --waiting-timeout, or shutdown)"),
    "preemptions": ("preemptions", "requests preempted to free pages"),
    "checkpoints_skipped": ("checkpoints_skipped", "recurrent checkpoints skipped for want of a slot"),
    # speculative decoding, as vLLM names it (a "draft" is one verify chunk)
    "spec_verify_steps": ("spec_decode_num_drafts", "verify chunks run (a decoding request's drafts, checked "
                                                    "in one step)"),
    "spec_draft_tokens": ("spec_decode_num_draft_tokens", "draft tokens verified"),
    "spec_accepted_tokens": ("spec_decode_num_accepted_tokens", "draft tokens kept (the model's own choice)"),
    "spec_no_room": ("spec_decode_drafts_cut", "times a step's drafts were halved for want of free pages or "
                                                "recurrent state slots (drafts never evict)"),
}
STORAGE_COUNTERS = {
    "storage_loads": ("storage_hits", "L3 reads that found their objects"),
    "storage_failed_loads": ("storage_misses", "L3 reads that came back short"),
    "storage_read_bytes": ("storage_read_bytes", "bytes read from L3 into the cache"),
    "storage_written_bytes": ("storage_written_bytes", "bytes written to L3"),
    "storage_saved_objects": ("storage_saved_objects", "objects written to L3"),
    "storage_errors": ("storage_errors", "L3 calls that failed"),
    "storage_corrupt_objects": ("storage_corrupt_objects", "L3 objects found corrupt or forged (never used)"),
    "storage_lost_objects": ("storage_lost_objects", "L3 objects believed stored but found missing (written "
                             "again at their path's next write)"),
    "storage_witness_mismatch": ("storage_witness_mismatches", "L3 namespaces found holding other weights' "
                                 "witness (L3 is then refused to this server)"),
    "storage_prefetches": ("storage_prefetches", "L3 reads started for a request"),
    "storage_prefetch_abandoned": ("storage_prefetches_abandoned", "L3 reads given up at their prefetch "
                                   "policy's deadline (the request computed instead)"),
    "storage_writes_dropped": ("storage_writes_dropped", "L3 writes dropped unwritten (the store fell behind "
                               "by more than the write queue holds)"),
    "storage_cross_instance_tokens": ("cached_tokens_cross_instance", "prompt tokens reused from L3 objects "
                                      "another instance wrote (a part of cached_tokens{tier=\"storage\"})"),
    "storage_instance_records_invalid": ("storage_instance_records_invalid", "announcement records in this "
                                         "server's L3 namespace that failed their checks (no instance: their "
                                         "slot is taken over once they stay still), each counted when first seen"),
}


class ServerMetrics:
    """The registry behind /metrics. `render(snapshot)` turns a snapshot (engine stats,
    queue lengths, sessions) into the exposition text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram("uniradix_time_to_first_token_seconds", "time to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("uniradix_inter_token_latency_seconds", "time between output tokens",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("uniradix_e2e_request_latency_seconds", "arrival to last token", buckets=_LATENCY,
                             registry=r)
        self.connections_open = Gauge("uniradix_connections_open", "HTTP connections open", registry=r)
        self.connections_closed = Counter(
            "uniradix_connections_closed", "connections the server closed, by why: header_timeout (no whole "
            "request head within --request-header-timeout), body_timeout (no whole body within "
            "--request-body-timeout), evicted (waiting longest for a request head, or sending a body longest, at "
            "--max-connections), write_timeout (the client read none of its answer for --response-write-timeout), "
            "shutdown (a body still arriving on shutdown, or a client still not reading past --graceful-timeout), "
            "bad_request (bytes that are not HTTP: answered 400)",
            ["reason"], registry=r)
        for reason in CLOSE_REASONS:  # every reason shows from the start, at 0
            self.connections_closed.labels(reason)
        self.connections_refused = Counter(
            "uniradix_connections_refused", "connections answered 503 at --max-connections, every open one "
            "busy with a request", registry=r)
        self.client_disconnects = Counter(
            "uniradix_client_disconnects", "requests whose client left before their whole answer went out "
            "(mid-body, while waiting for a whole response, mid-stream); not those the server cut itself",
            registry=r)
        self.request_log_lines_dropped = Counter(
            "uniradix_request_log_lines_dropped", "--request-log lines not written: its queue was full (the file "
            "took lines slower than they came) or the file refused them", registry=r)
        self.requests_refused = Counter(
            "uniradix_requests_refused", "requests answered 503 for overload, by why: queue_full (refused at once "
            "at --max-queued-requests; a retry keeps its place in line), waiting_timeout (queued past "
            "--waiting-timeout without starting)", ["reason"], registry=r)
        for reason in ("queue_full", "waiting_timeout"):
            self.requests_refused.labels(reason)
        self.waitlisted_requests = Gauge(
            "uniradix_waitlisted_requests", "requests refused at a full queue whose place in line is kept for "
            "their retries (waitlist.py)", registry=r)
        self._snapshot: dict | None = None
        r.register(self)

    def finished(self, req) -> None:
        if req.metrics.latency is not None and req.status == "finished":
            self.e2e.observe(req.metrics.latency)

    def render(self, snapshot: dict) -> bytes:
        self._snapshot = snapshot
        try:
            return generate_latest(self.registry)
        finally:
            self._snapshot = None

    def collect(self):
        """The engine's counters (a prometheus_client custom collector)."""
        if self._snapshot is not None:
            yield from engine_families(self._snapshot)

    def values(self, snapshot: dict) -> dict[str, float]:
        """Every series of the engine's families for `snapshot` and of the latency
        histograms (their sums and counts; TTFT's buckets too, the dashboard's
        percentiles), keyed as /metrics writes them
        (`uniradix_cached_tokens_total{tier="device"}`): what the dashboard shows is
        what /metrics says, from the same derivation. Safe on any thread (render's
        snapshot is not touched)."""
        out = {}
        histograms = (f for h in (self.ttft, self.itl, self.e2e) for f in h.collect())
        for fam in (*engine_families(snapshot), *histograms):
            for sample in fam.samples:
                if sample.name.endswith("_created") or (sample.name.endswith("_bucket") and
                                                        not sample.name.startswith(TTFT_BUCKETS)):
                    continue
                out[series_key(sample.name, sample.labels)] = float(sample.value)
        return out


def series_key(name: str, labels: dict) -> str:
    """A series' name as the text exposition writes it: `name{label="value",...}`."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def engine_families(s: dict):
    """The metric families of one snapshot ({"engine": Engine.stats(), "output_tokens",
    "sessions"}, taken on the scheduler thread): a pure function of it, so that
    /metrics and the dashboard say the same."""
    st = s["engine"]
    for key, (name, doc) in {**ENGINE_COUNTERS, **STORAGE_COUNTERS}.items():
        yield _counter(name, doc, st.get(key, 0))
    device = st["cached_tokens"] - st["host_tokens"] - st["storage_tokens"]
    c = CounterMetricFamily("uniradix_cached_tokens", "prompt tokens reused, by the tier they came from",
                            labels=["tier"])
    for tier, v in (("device", device), ("host", st["host_tokens"]), ("storage", st["storage_tokens"])):
        c.add_metric([tier], v)
    yield c
    yield _counter("output_tokens", "tokens sent to clients", s["output_tokens"])
    per_pos = st.get("spec_accepted_per_pos") or ()
    if per_pos:
        c = CounterMetricFamily("uniradix_spec_decode_num_accepted_tokens_per_pos",
                                "draft tokens kept, by their position in the verify chunk", labels=["position"])
        for pos, v in enumerate(per_pos):
            c.add_metric([str(pos)], v)
        yield c
    yield GaugeMetricFamily("uniradix_running_requests", "requests running (prefetching from L3 included)",
                            value=st["running"] + st["prefetching"])
    yield GaugeMetricFamily("uniradix_waiting_requests", "requests queued for admission", value=st["waiting"])
    yield GaugeMetricFamily("uniradix_storage_refused", "1 when L3 is refused to this server (its namespace "
                            "holds other weights' witness: no reads, no writes)", value=st.get("storage_refused", 0))
    yield GaugeMetricFamily("uniradix_storage_pending_writes", "L3 writes queued for the store now",
                            value=st.get("storage_pending_writes", 0))
    yield GaugeMetricFamily("uniradix_storage_instances_seen", "other instances announcing themselves in this "
                            "server's L3 namespace now (0: L3 is shared with no one)",
                            value=st.get("storage_instances_seen", 0))
    yield GaugeMetricFamily("uniradix_sessions_open", "sessions open", value=s["sessions"])
    yield GaugeMetricFamily("uniradix_session_references", "sessions whose next turn the tree keeps "
                            "referenced", value=st["cache"]["sessions"])
    comps = st["cache"]["components"]
    host = st["cache"].get("host")
    for name, (key, doc, is_counter) in PER_COMPONENT.items():
        if name in HOST_TIER_SERIES and host is None:
            continue  # no host tier: no host pool to show
        fam = (CounterMetricFamily if is_counter else GaugeMetricFamily)(f"uniradix_{name}", doc,
                                                                        labels=["component"])
        for comp, cs in comps.items():
            if cs.get(key) is not None:
                fam.add_metric([comp], cs[key])
        yield fam
    if host is not None:
        yield _counter("host_loads", "load-backs from the host tier (L2)", host["loads"])
        yield _counter("host_loaded_handles", "pages (state slots) loaded back from L2", host["loaded_handles"])
        yield _counter("host_written_handles", "pages (state slots) written to L2",
                       host["written_handles"] + host["written_back"])


HOST_TIER_SERIES = ("host_cached_pages", "host_pool_pages", "host_pool_available_pages")

#: per-component series: metric name -> (key in the cache's component stats, help, counter?)
PER_COMPONENT = {
    "evicted_pages": ("evicted", "pages (state slots) evicted from the device, per component", True),
    "host_evicted_pages": ("host_evicted", "pages evicted from the host tier, per component", True),
    "tombstones": ("tombstones", "nodes whose slot of this component is gone (tombstoned) now", False),
    "cached_pages": ("size", "pages (state slots) the tree holds on the device", False),
    "pool_pages": ("pool_size", "device pool size in pages (state slots)", False),
    "pool_available_pages": ("pool_available", "device pool pages free (cached pages that could be "
                                               "evicted not counted)", False),
    "host_cached_pages": ("host_size", "pages (state slots) the tree holds on the host tier (L2)", False),
    "host_pool_pages": ("host_pool_size", "host pool size in pages (state slots)", False),
    "host_pool_available_pages": ("host_pool_available", "host pool pages free (cached pages that could be "
                                                         "evicted not counted)", False),
}


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(f"uniradix_{name}", doc, value=value)
