"""benchmarks/engine_ab.py and benchmarks/threads.py run end to end on the embedded
model with tiny settings: they print their tables and one JSON line, and each A/B
change's two passes give identical replies."""
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


def ab(change: str, *args: str, tmp_path) -> tuple[str, dict]:
    out = run_script("engine_ab.py", change, "--model-path", "tiny-hybrid", "--clients", "3", "--rounds", "2",
                     "--tokens-per-round", "24", "--output-tokens", "3", "--page-size", "4", "--repeats", "1",
                     *args, tmp_path=tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["replies_identical"] is True and result["errors"] == 0
    return out, result


def test_head_rows_ab_compares_identical_replies(tmp_path):
    out, result = ab("head-rows", "--shared-prefix-tokens", "40", tmp_path=tmp_path)
    assert "every row" in out and "sampled rows" in out
    assert result["baseline"]["all"]["hit_rate"] == result["change_on"]["all"]["hit_rate"] > 0


def test_prefix_sharing_ab_reuses_the_preamble_in_round_one(tmp_path):
    """Three clients open with one 96-token preamble at once: with sharing the two later
    ones resume after it in round 1 (2 x 96 of the prompt tokens), without it none do."""
    out, result = ab("prefix-sharing", "--shared-prefix-tokens", "96", "--first-round-tokens", "20",
                     tmp_path=tmp_path)
    assert "no sharing" in out
    assert result["baseline"]["round1"]["hit_rate"] == 0
    assert result["change_on"]["round1"]["hit_rate"] >= 2 * 96 / (3 * (96 + 20) + 30)
    assert result["shared_prefixes"][0] >= 1


def test_threads_benchmark_measures_idle_and_busy(tmp_path):
    out = run_script("threads.py", "--model-path", "tiny-hybrid", "--threads", "1,2", "--prompt", "32",
                     "--decode", "2", "--repeats", "1", "--busy", "1", tmp_path=tmp_path)
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    assert [(r["machine"], r["threads"]) for r in rows] == [("idle", 1), ("idle", 2), ("busy", 1), ("busy", 2)]
    assert all(r["prefill_tok_s"] > 0 and r["decode_ms"] > 0 for r in rows)


def test_kernels_ab_runs_both_kernels(tmp_path):
    """The row-invariant kernels against torch's in one process (kernels.off() for the
    baseline): the same hit rate; replies may differ only where greedy meets a near tie,
    so they are not compared here."""
    out = run_script("engine_ab.py", "kernels", "--model-path", "tiny-hybrid", "--clients", "2", "--rounds", "2",
                     "--tokens-per-round", "24", "--output-tokens", "3", "--page-size", "4", "--repeats", "1",
                     tmp_path=tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert "torch's kernels" in out and "row-invariant kernels" in out and result["errors"] == 0
    assert result["baseline"]["all"]["hit_rate"] == result["change_on"]["all"]["hit_rate"] > 0
