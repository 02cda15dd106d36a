"""The benchmark scripts run end to end on tiny settings: they print their tables, and a
missing optional dependency (matplotlib, the plots extra) costs only the plot."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# run a script with matplotlib made unimportable, as on a machine without the plots extra
NO_MATPLOTLIB = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_multiturn_tiers_without_matplotlib_prints_tables_and_skips_the_plot(tmp_path):
    plot = tmp_path / "tiers.png"
    cmd = [sys.executable, "-c", NO_MATPLOTLIB, str(ROOT / "benchmarks" / "multiturn_tiers.py"),
           "--clients", "2", "--rounds", "2", "--first-round-tokens", "48", "--tokens-per-round", "8",
           "--output-tokens", "2", "--max-total-tokens", "256", "--repeats", "2", "--prefetch-threshold", "8",
           "--plot", str(plot)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "plot skipped" in out.stdout + out.stderr and "plots" in out.stdout + out.stderr
    assert not plot.exists()
    assert "hit rates identical in all 2 passes" in out.stdout
    assert "L1+L2+L3 / L1 input throughput" in out.stdout


@pytest.mark.skipif(shutil.which("redis-server") is None,
                    reason="redis-server is not on PATH (apt-get install redis-server)")
def test_multiturn_tiers_over_redis_reads_l3_and_compares_with_raw(tmp_path):
    """--storage redis: the script starts its own redis-server on 127.0.0.1, and stops
    it by its PID. The working set outgrows L1 and L2, so the L3 pass resumes from
    storage; its loads are printed against a raw redis-py GET of the same sizes."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "multiturn_tiers.py"), "--storage", "redis",
           "--clients", "8", "--rounds", "4", "--first-round-tokens", "64", "--tokens-per-round", "16",
           "--output-tokens", "2", "--max-total-tokens", "256", "--hicache-ratio", "2", "--repeats", "1",
           "--prefetch-threshold", "8", "--threads", "1", "--plot", ""]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    pid = int(re.search(r"redis: started on 127\.0\.0\.1 \(PID (\d+)\)", out.stderr).group(1))
    with pytest.raises(ProcessLookupError):   # stopped by the script
        os.kill(pid, 0)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data["storage"] == "redis" and data["threads"] == 1
    (l3,) = data["tokens"]["L1+L2+L3"]
    assert l3["storage_tokens"] > 0 and l3["errors"] == 0
    assert all(t["storage_tokens"] == 0 for c in ("L1", "L1+L2") for t in data["tokens"][c])
    loads = data["loads"]["L1+L2+L3"]["l3"]
    assert loads["backend"] == "redis" and loads["get_objects"] > 0 and loads["get_bytes"] > 0
    assert loads["raw_gbps"] is not None and loads["raw_gbps"] > 0
    assert re.search(r"L3 -> L2 \(store -> host\), L1\+L2\+L3, redis: loaded [\d.,]+ MB in \d+ reads at "
                     r"[\d.]+ GB/s = \d+% of raw .*raw: redis-py GET pipelines", out.stdout)
    assert re.search(r"L2 -> L1 \(host -> device\), L1\+L2: loaded [\d.,]+ MB .* of raw", out.stdout)


def test_serve_vs_peers_dry_run_serves_chat_over_http_and_compares(tmp_path):
    """benchmarks/serve_vs_peers.py --dry: `uniradix serve` on the embedded model, cache on
    against cache off (standing in for a peer), over streamed chat. The figures are what a
    cache must give: the same prompts and replies on both sides, every reply as long as
    asked, the earlier turns reused with the cache on and nothing without; the tables are
    printed and both servers are stopped."""
    figures = tmp_path / "figures.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_vs_peers.py"), "--dry", "--server-cpus", "none",
           "--log-dir", str(tmp_path / "logs"), "--json", str(figures)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    data = json.loads(figures.read_text())
    runs = {r["server"]: r for r in data["results"]}
    assert set(runs) == {"uniradix-embedded", "uniradix-embedded-nocache"}
    assert not [r["error"] for r in runs.values() if "error" in r]
    w = data["workload"]
    on, off = runs["uniradix-embedded"]["phases"], runs["uniradix-embedded-nocache"]["phases"]
    for phase, clients, rounds in (("multi-turn", w["clients"], w["rounds"]), ("long", 1, w["long_rounds"])):
        assert len(on[phase]) == len(off[phase]) == rounds
        for a, b in zip(on[phase], off[phase]):
            assert a["errors"] == b["errors"] == []
            assert a["prompt_tokens"] == b["prompt_tokens"] > 0
            assert a["replies"] == b["replies"] and all(a["replies"])
            assert a["completion_tokens"] == b["completion_tokens"] == clients * w["output_tokens"]
            assert len(a["ttfts"]) == len(b["ttfts"]) == clients
            assert b["cached_tokens"] == 0
        later = on[phase][1:]
        assert later and all(r["cached_tokens"] > r["prompt_tokens"] / 2 for r in later)
    (row,) = [r for r in data["ratios"] if r["phase"] == "multi-turn"]
    assert row["peer"] == "uniradix-embedded-nocache" and row["hit_peer"] == 0 and row["hit_ours"] > 0
    assert row["same_replies"] == f"{w['clients'] * w['rounds']}/{w['clients'] * w['rounds']}"
    assert "hit rate" in out.stdout and "ratios, ours / peer" in out.stdout
    for r in runs.values():  # stopped: the PID is gone or no longer that server
        try:
            with open(f"/proc/{r['pid']}/cmdline", "rb") as f:
                assert b"serve" not in f.read()
        except FileNotFoundError:
            pass


def test_llama_cpp_is_run_as_chat_is_served(monkeypatch):
    """serve_vs_peers starts llama.cpp's server with --logits_all false (its default, true,
    puts every prompt row through the head, which no chat user asks for), and flags given
    with --llamacpp-args come after it, so they win."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import serve_vs_peers as svp
    ap = __import__("argparse").ArgumentParser()
    svp.add_server_args(ap, vllm_kv_gib=2, request_timeout=60)
    for extra, want in (([], "false"), (["--llamacpp-args", "--logits_all true"], "true")):
        a = ap.parse_args(extra)
        a.gguf, a.context, a.server_cpus = "model.gguf", 4096, None
        cmd, _ = svp.command(svp.SERVERS["llamacpp"], a, 8000)
        flags = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--logits_all"]
        assert flags[0] == "false" and flags[-1] == want


def test_speculative_servers_dry_run_compares_a_server_with_and_without(tmp_path):
    """benchmarks/speculative_servers.py --dry: `uniradix serve` on the embedded model with
    speculation off, then on, over streamed chat: every reply the same text on both sides
    (the stream's text does not depend on how many tokens a step brought), the hit rate
    of every turn the same, the figures printed; both servers stopped."""
    figures = tmp_path / "figures.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "speculative_servers.py"), "--dry", "--server-cpus", "none",
           "--turns", "2", "--output-tokens", "12", "--log-dir", str(tmp_path / "logs"), "--json", str(figures)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (r,) = json.loads(figures.read_text())["results"]
    assert r["server"] == "uniradix-embedded" and "error" not in r["off"] and "error" not in r["on"]
    assert set(r["compared"]) == {"chat", "agentic", "document"}
    for c in r["compared"].values():
        assert c["replies_same"] == c["replies"] == 4 and c["hit_rates_same"] and c["speedup"] > 0
    assert "replies same" in out.stdout


def test_request_parsing_runs_every_body_through_the_routes_parsers(tmp_path):
    """benchmarks/request_parsing.py: each case (the three routes' bodies, small and
    large) goes through parse_json and the route's parse_* (a body they refused would end
    the script), beside json.loads of the same bytes; the CPU and the tree measured are
    named. The times themselves are the benchmark's to print, not a test's to judge."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "request_parsing.py"), "--batches", "2", "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(data["protocol"]).resolve() == (ROOT / "src" / "uniradix" / "server" / "protocol.py").resolve()
    assert data["cpu"] and f"CPU: {data['cpu']}" in out.stdout
    kinds = {case.split(",")[0].split()[0] for case in data["results"]}
    assert kinds == {"generate", "completion", "chat"} and len(data["results"]) == 8
    for case, r in data["results"].items():
        assert r["bytes"] > 0 and r["json_loads_us"] > 0 and r["parse_us"] > 0 and r["json_and_parse_us"] > 0, case
        assert case in out.stdout
