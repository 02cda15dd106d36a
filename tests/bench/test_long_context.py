"""benchmarks/long_context.py runs end to end on the embedded preset: one conversation
served by `uniradix serve` over streamed chat, growing turn by turn, each turn reusing
the earlier ones; its JSON line carries every turn's figures and the summary, and the
server it started is gone when it ends."""
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_long_context_grows_one_conversation_reuses_it_and_stops_its_server(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "long_context.py"), "--turn-tokens", "40",
           "--max-context", "400", "--output-tokens", "4", "--depths", "128,256,100000", "--server-cpus", "none",
           "--log-dir", str(tmp_path / "logs"), "--json", str(tmp_path / "figures.json")]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    data = json.loads(out.stdout.strip().splitlines()[-1])
    assert data == json.loads((tmp_path / "figures.json").read_text())
    assert data["cpu"]["model"] and "avx2" in data["cpu"]["flags"] and data["date"]
    (run,) = data["engines"]
    assert run["engine"] == "uniradix" and "error" not in run
    turns = run["turns"]
    assert len(turns) >= 3
    depths = [t["depth"] for t in turns]
    assert all(b > a for a, b in itertools.pairwise(depths)), depths
    assert depths[-1] + data["settings"]["output_tokens"] <= 400
    for t in turns:
        assert t["ttft_s"] > 0 and t["decode_ms"] > 0 and t["input_tps"] > 0
        assert t["rss_mib"] > 0 and t["rss_peak_mib"] > 0
        assert t["completion_tokens"] == 4
    for prev, t in itertools.pairwise(turns):
        assert t["cached"] > 0 and t["hit"] > 0
        assert t["cached"] >= prev["depth"] // 2  # the earlier turns came back from the cache
    by_target = {row["target"]: row for row in run["summary"]}
    assert set(by_target) == {128, 256, 100000}
    for target in (128, 256):
        near = by_target[target]
        assert near["turn"] is not None and abs(near["depth"] - target) <= 20
        assert near == dict(target=target, **turns[near["turn"] - 1])
    assert by_target[100000]["turn"] is None and by_target[100000]["deepest"] == depths[-1]
    assert "not reached" in out.stdout and "decode ms/tok" in out.stdout
    for pid in run["pids"]:  # the server and what it started: stopped, by PID
        assert run["pid"] in run["pids"]
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert b"uniradix" not in f.read(), f"process {pid} still runs"
        except FileNotFoundError:
            pass
