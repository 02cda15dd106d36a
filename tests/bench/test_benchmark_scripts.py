"""The benchmark scripts run end to end on tiny settings: they print their tables, and a
missing optional dependency (matplotlib, the plots extra) costs only the plot."""
import os
import subprocess
import sys
from pathlib import Path

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
