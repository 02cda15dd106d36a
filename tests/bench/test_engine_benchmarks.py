"""benchmarks/head_rows.py and benchmarks/threads.py run end to end on the embedded
model with tiny settings: they print their tables and one JSON line, and the head
benchmark's two passes give identical replies."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *args: str, tmp_path) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_head_rows_benchmark_compares_identical_replies(tmp_path):
    out = run_script("head_rows.py", "--model-path", "tiny-hybrid", "--clients", "2", "--rounds", "2",
                     "--tokens-per-round", "24", "--output-tokens", "3", "--shared-prefix-tokens", "40",
                     "--repeats", "1", tmp_path=tmp_path)
    assert "every row" in out and "sampled rows" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["replies_identical"] is True and result["errors"] == 0
    assert result["every_row"]["hit_rate"] == result["sampled_rows"]["hit_rate"] > 0


def test_threads_benchmark_measures_idle_and_busy(tmp_path):
    out = run_script("threads.py", "--model-path", "tiny-hybrid", "--threads", "1,2", "--prompt", "32",
                     "--decode", "2", "--repeats", "1", "--busy", "1", tmp_path=tmp_path)
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    assert [(r["machine"], r["threads"]) for r in rows] == [("idle", 1), ("idle", 2), ("busy", 1), ("busy", 2)]
    assert all(r["prefill_tok_s"] > 0 and r["decode_ms"] > 0 for r in rows)
