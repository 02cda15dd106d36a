"""`GET /dashboard` in a real headless Chromium (Debian's `chromium`, started here with
no network beyond loopback): the page loads offline, its script runs, and every number
it shows that is a /metrics series equals what /metrics says, before and after traffic.
Without Chromium the browser cases are skipped, unless UNIRADIX_REQUIRE_BROWSER=1
(.ci/run sets it, so CI never skips them)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from html.parser import HTMLParser

import pytest
from server_proc import HANG_S, ServerProc

from uniradix.server.dashboard import HISTORY_SERIES, History, quantiles
from uniradix.server.metrics import TTFT_BUCKETS, ServerMetrics, series_key

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("UNIRADIX_REQUIRE_BROWSER") != "1",
    reason="no chromium on PATH (apt-get install chromium)")

#: as the machine's probe starts it: headless, no sandbox (root), nothing off loopback
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--hide-scrollbars")


def browse(url: str, *extra: str) -> str:
    """Chromium's DOM of `url` after its script ran (virtual time: the first load and a
    refresh or two); `extra` flags instead of --dump-dom, e.g. a screenshot."""
    assert CHROMIUM is not None, "UNIRADIX_REQUIRE_BROWSER=1 but no chromium on PATH"
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                              "--virtual-time-budget=4000", *(extra or ("--dump-dom",)), url],
                             capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


class Numbers(HTMLParser):
    """Every element carrying a /metrics series: (series, raw value, text shown)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[list] = []
        self.attrs: dict[str, dict] = {}
        self._open: list | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.attrs[a["id"]] = a
        if tag == "body":
            self.attrs["body"] = a
        if "data-metric" in a:
            self._open = [a["data-metric"], float(a["data-value"]), ""]
            self.found.append(self._open)

    def handle_data(self, data):
        if self._open is not None:
            self._open[2] += data

    def handle_endtag(self, tag):
        self._open = None


def shown(dom: str) -> Numbers:
    p = Numbers()
    p.feed(dom)
    return p


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Every section has something to show: a host tier and a file L3 under it, and
    speculation (prompt lookup)."""
    store = tmp_path_factory.mktemp("l3")
    s = ServerProc("--max-total-tokens", "1024", "--enable-hierarchical-cache", "--hicache-ratio", "2",
                   "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
                   json.dumps({"path": str(store)}), "--speculative-algorithm", "NGRAM")
    yield s
    assert s.stop() == 0, "".join(s.lines[-30:])


def traffic(server, n: int, sessions: int = 3) -> None:
    for i in range(n):
        ids = [(7 * i + 3 * (i % sessions) + j) % 250 + 1 for j in range(40)]
        body = {"input_ids": list(range(1, 60)) + ids, "session_id": f"s{i % sessions}",
                "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        assert server.post("/generate", body)[0] == 200


def settle(server) -> None:
    """Nothing running, waiting, or still being written to L3: no number moves."""
    deadline = time.monotonic() + HANG_S
    while server.wait_idle()["uniradix_storage_pending_writes"] and time.monotonic() < deadline:
        time.sleep(0.05)


def sampled_after(server, finished: float) -> None:
    """The history holds a sample that counts `finished` requests and an earlier one (a
    sample every SAMPLE_S seconds): the page's last-minute rates are numbers, not "-",
    however fast the traffic ran."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        h = server.get("/dashboard/data")[1]["history"]
        if len(h) >= 2 and h[-1]["finished"] >= finished:
            return
        time.sleep(0.1)
    raise AssertionError(f"no second history sample after {finished} finished requests: {h[-2:]}")


def check_against_metrics(server, dom: str) -> dict:
    """Each number the page shows is /metrics' series of the same name (the server idle,
    so nothing moves in between); returns {series: value} as shown."""
    page = shown(dom)
    assert page.attrs["body"].get("data-loaded"), "the page's script did not render"
    assert "bad" not in page.attrs["status"].get("class", ""), dom[-3000:]
    metrics = server.metrics()
    values = {}
    for series, value, text in page.found:
        assert series in metrics, f"{series} is shown but /metrics has no such series"
        assert value == metrics[series], (series, value, metrics[series])
        digits = text.replace(",", "")
        if digits.isdigit():  # bytes are shown in KiB, MiB...; every count as the integer it is
            assert int(digits) == round(value), (series, text, value)
        values[series] = value
    return values


@needs_browser
def test_the_page_shows_what_metrics_says_before_and_after_traffic(server):
    url = f"http://127.0.0.1:{server.port}/dashboard"
    settle(server)
    before = check_against_metrics(server, browse(url))
    traffic(server, 12)
    settle(server)
    after = check_against_metrics(server, browse(url))
    assert after["uniradix_prompt_tokens_total"] > before["uniradix_prompt_tokens_total"]
    assert after['uniradix_cached_tokens_total{tier="device"}'] > 0 and after["uniradix_sessions_open"] >= 3
    assert after["uniradix_requests_finished_total"] - before["uniradix_requests_finished_total"] == 12
    # everything the issue names is on the page: hit rate per tier, the queues, each
    # component's pools on both tiers, tombstones, checkpoints, L3 traffic and errors
    components = [c["name"] for c in server.get("/dashboard/data")[1]["components"]]
    need = {f'uniradix_cached_tokens_total{{tier="{t}"}}' for t in ("device", "host", "storage")}
    need |= {"uniradix_running_requests", "uniradix_waiting_requests", "uniradix_sessions_open",
             "uniradix_storage_hits_total", "uniradix_storage_errors_total", "uniradix_storage_written_bytes_total",
             "uniradix_spec_decode_num_drafts_total", "uniradix_spec_decode_num_draft_tokens_total",
             "uniradix_spec_decode_num_accepted_tokens_total"}
    for c in components:
        need |= {f'{name}{{component="{c}"}}' for name in (
            "uniradix_pool_pages", "uniradix_pool_available_pages", "uniradix_cached_pages", "uniradix_tombstones",
            "uniradix_host_pool_pages", "uniradix_host_pool_available_pages", "uniradix_host_cached_pages")}
    assert need <= set(after), sorted(need - set(after))
    assert after["uniradix_storage_written_bytes_total"] > 0  # write-through reached the store
    assert after["uniradix_spec_decode_num_drafts_total"] > 0  # the prompts' runs of numbers draft their replies
    # what an operator looks at first: TTFT percentiles, the last minute's decode and
    # request rates, and a time axis in clock time
    sampled_after(server, after["uniradix_requests_finished_total"])
    dom = browse(url)
    text = re.sub(r"<[^>]+>", " ", dom)
    p50 = re.search(r"TTFT p50 / p90 / p99\s+(\d+) / (\d+) / (\d+) ms", text)
    assert p50 and int(p50.group(1)) <= int(p50.group(2)) <= int(p50.group(3)), text[:3000]
    assert re.search(r"decode, last minute\s+[0-9.]+ tok/s\s+requests [0-9.]+/s finished", text), text[:3000]
    assert ">now<" not in dom and re.search(r"\d{1,2}:\d{2}:\d{2}", text)


def pools_used(server) -> dict:
    """Each pool's share in use, as /metrics says: {(tier prefix, component): share}."""
    metrics = server.metrics()
    out = {}
    for c in [c["name"] for c in server.get("/dashboard/data")[1]["components"]]:
        for prefix in ("", "host_"):
            size = metrics.get(f'uniradix_{prefix}pool_pages{{component="{c}"}}')
            if size:
                free = metrics[f'uniradix_{prefix}pool_available_pages{{component="{c}"}}']
                out[(prefix, c)] = (size - free) / size
    return out


@needs_browser
def test_a_pool_nearly_full_is_marked(server):
    """A pool from 90% used is marked "nearly full" (what it caches is evicted about as
    fast as requests come), and no other: the page marks exactly the pools /metrics shows
    at 90% or more. Distinct prompts fill the device pools with cached pages first."""
    for i in range(60):
        if any(share >= 0.9 for (prefix, _), share in pools_used(server).items() if prefix == ""):
            break
        body = {"input_ids": [(31 * i + 7 * j) % 250 + 1 for j in range(120)],
                "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        assert server.post("/generate", body)[0] == 200
    settle(server)
    used = pools_used(server)
    full = sum(share >= 0.9 for share in used.values())
    assert full >= 1, used
    dom = browse(f"http://127.0.0.1:{server.port}/dashboard")
    assert shown(dom).attrs["body"].get("data-loaded"), "the page's script did not render"
    assert pools_used(server) == used   # nothing moved while the page loaded
    assert dom.count('class="full-note"') == full, (used, re.findall(r"\d+%( nearly full)?", dom))


@needs_browser
def test_a_screenshot_renders(server, tmp_path):
    png = tmp_path / "dashboard.png"
    browse(f"http://127.0.0.1:{server.port}/dashboard", f"--screenshot={png}", "--window-size=1280,1000")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_the_page_needs_nothing_from_outside(server):
    status, page, headers = server.get("/dashboard")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "<script>" in page and "<style>" in page
    # no external script, style sheet, image, font or import: the page works offline
    assert not re.search(r"""(src|href)\s*=|url\(|@import|https?://""", page), "an external asset"


def test_history_and_data_follow_the_counters(server):
    traffic(server, 2)
    m = server.wait_idle()
    status, data, _ = server.get("/dashboard/data")
    assert status == 200 and data["sample_s"] > 0 and data["history"], data.keys()
    h = data["history"]
    assert all(a["t"] < b["t"] and a["prompt"] <= b["prompt"] for a, b in zip(h, h[1:]))
    assert h[-1]["prompt"] <= m["uniradix_prompt_tokens_total"]
    assert data["metrics"]["uniradix_prompt_tokens_total"] == m["uniradix_prompt_tokens_total"]
    assert data["tiers"]["host"] and data["tiers"]["storage_backend"] == "FileBackend"
    assert any(c["checkpoint"] for c in data["components"])  # tiny-hybrid's recurrent layer


def test_values_are_the_exposition_series():
    """ServerMetrics.values(snapshot) is /metrics' text for the same snapshot, series by
    series (the server's own connection counters aside): one derivation, two views."""
    m = ServerMetrics()
    m.ttft.observe(0.02)
    comps = {name: {"size": 5, "evicted": 2, "host_evicted": 1, "tombstones": 1, "pool_size": 64,
                    "pool_available": 50, "host_size": 3, "host_pool_size": 128, "host_pool_available": 120}
             for name in ("full", "swa", "mamba")}
    engine = {"cached_tokens": 30, "host_tokens": 7, "storage_tokens": 3, "prompt_tokens": 50, "running": 1,
              "prefetching": 1, "waiting": 2,
              "cache": {"sessions": 1, "components": comps,
                        "host": {"loads": 1, "loaded_handles": 4, "written_handles": 6, "written_back": 1}}}
    snap = {"engine": engine, "output_tokens": 9, "sessions": 2}
    text = {}
    for line in m.render(snap).decode().splitlines():
        if line and not line.startswith("#"):
            k, val = line.rsplit(" ", 1)
            text[k] = float(val)
    own = ("uniradix_connections", "uniradix_client_disconnects", "uniradix_request_log", "uniradix_requests_refused",
           "uniradix_waitlisted")
    text = {k: x for k, x in text.items() if not k.startswith(own) and "_created" not in k
            and ("_bucket" not in k or k.startswith(TTFT_BUCKETS))}
    assert m.values(snap) == text
    assert text['uniradix_cached_tokens_total{tier="device"}'] == 20
    assert text['uniradix_host_pool_available_pages{component="swa"}'] == 120
    # without a host tier there is no host pool to show
    engine["cache"].pop("host")
    assert not any(k.startswith(("uniradix_host_pool", "uniradix_host_cached")) for k in m.values(snap))


def test_ttft_percentiles_from_the_buckets():
    """The dashboard's TTFT p50 / p90 / p99: Prometheus' histogram_quantile over the
    buckets /metrics exposes (values keeps them), within the bucket each falls in."""
    m = ServerMetrics()

    def values():  # the TTFT series as values() keys them (test_values_are_the_exposition_series)
        return {series_key(x.name, x.labels): x.value for f in m.ttft.collect() for x in f.samples}
    assert quantiles(values()) == {"p50": None, "p90": None, "p99": None}
    for x in [0.003] * 50 + [0.3] * 40 + [3.0] * 10:
        m.ttft.observe(x)
    v = values()
    assert v[TTFT_BUCKETS + '{le="+Inf"}'] == 100 and v[TTFT_BUCKETS + '{le="0.005"}'] == 50
    q = quantiles(v)
    assert 0.0025 < q["p50"] <= 0.005 and 0.25 < q["p90"] <= 0.5 and 2.5 < q["p99"] <= 5.0
    m.ttft.observe(100.0)   # past the last finite bound: that bound
    assert quantiles(values(), qs=(1.0,)) == {"p100": 60.0}


def test_history_samples_at_its_interval():
    values = {s: 0.0 for s in HISTORY_SERIES.values()}
    h = History(None, interval=3600, keep=2)
    calls = []

    class Metrics:
        def values(self, snap):
            calls.append(snap)
            return values
    h.metrics = Metrics()
    h.tick(lambda: "snap")
    h.tick(lambda: "snap")          # within the interval: no sample, no snapshot taken
    assert len(h.samples) == 1 and calls == ["snap"]
    for n in (5, 9, 12):
        values["uniradix_prompt_tokens_total"] = n
        h.record(values)
    assert [s["prompt"] for s in h.samples] == [9, 12]  # the oldest go first
