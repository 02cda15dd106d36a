"""How fast and in how much memory `uniradix hit-rate` and `uniradix simulate` read and
replay a big request log: it writes one (benchmarks/request_log_gen.py: 10^6 lines by
default) unless given one, runs each command as its own process, and prints lines/s,
requests/s and the peak RSS of each (the process's, imports included), with the CPU and
the load the machine was under.

    python benchmarks/log_tools.py [--log PATH | --lines 1000000] [--skip-simulate]
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

import request_log_gen

#: run in the child: the command, then its own peak RSS (KB) on stderr
CHILD = ("import resource, sys; from uniradix.cli import main; rc = main(sys.argv[1:]); "
         "print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def run(args: list[str]) -> tuple[float, int, str]:
    """(seconds, peak RSS in MB, stdout) of `uniradix ARGS` in a process of its own."""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=False)
    dt = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"uniradix {' '.join(args)}: exit {out.returncode}\n{out.stderr[-2000:]}")
    rss = int(out.stderr.rsplit("maxrss ", 1)[1].split()[0]) // 1024
    return dt, rss, out.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log", help="a request log to read (default: one written here)")
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--skip-simulate", action="store_true")
    a = p.parse_args()
    log = a.log
    if log is None:
        log = os.path.join(tempfile.mkdtemp(), "requests.jsonl")
        t = time.perf_counter()
        request_log_gen.write(log, a.lines)
        print(f"wrote {log} in {time.perf_counter() - t:.0f} s")
    with open(log, "rb") as f:
        lines = sum(1 for _ in f)
    size = os.path.getsize(log)
    print(f"{lines:,} lines, {size / 1e6:.0f} MB; {cpu_name()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start")
    dt, rss, out = run(["hit-rate", log])
    print(f"hit-rate: {dt:.0f} s, {lines / dt:,.0f} lines/s, peak RSS {rss} MB")
    print("  " + out.strip().splitlines()[-1])
    if not a.skip_simulate:
        dt, rss, out = run(["simulate", log])
        n = int(out.split(" requests", 1)[0].replace(",", ""))
        print(f"simulate: {dt:.0f} s, {lines / dt:,.0f} lines/s ({n / dt:,.0f} requests/s replayed), peak RSS "
              f"{rss} MB")
        print("  " + [line for line in out.splitlines() if line.strip()][-1].strip())
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
