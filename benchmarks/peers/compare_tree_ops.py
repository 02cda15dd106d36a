"""Side-by-side tree-operation benchmark: this project against SGLang, same trace, one run.

    benchmarks/peers/setup_sglang.sh                      # once; about 2.5 GB
    /tmp/sglang-peer/bin/python benchmarks/peers/compare_tree_ops.py \
        --project . --mode full [--requests 10000] [--rounds 3]

It writes the trace (trace.py) once, then runs, in turn for each round, every
SGLang implementation for the mode and the project's own benchmark:

    <project python> benchmarks/tree_ops.py --trace FILE --capacity N --mode MODE --json

which must print, as its last line, one JSON object with at least
`hit_rate`, `evicted_tokens` and `req_per_s` (requests per second through the
loop: match, lock, evict if short, allocate, insert, unlock). It prints the
median of each and the ratio of the project to each peer (with `--draft-index`, also
the project with speculation's draft index kept in step: what SUFFIX drafts cost).

Modes: full (FULL only; peers: SGLang 0.5.23 RadixCache, UnifiedRadixCache
with Python and Rust tree cores), swa (FULL+SWA, window 4096; peer: 0.5.20
SWARadixCache), mamba (FULL+MAMBA, 512 state slots; peer: 0.5.20
MambaRadixCache).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = {
    "full": ["radix", "unified-python", "unified-rust"],
    "swa": ["swa"],
    "mamba": ["mamba"],
}
OLD = {"swa", "mamba"}  # need SGLang 0.5.20


def last_json(out: str) -> dict:
    for line in reversed(out.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in output:\n" + out[-2000:])


def run(cmd, env=None, cwd=None) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return last_json(p.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--project", default=".")
    ap.add_argument("--project-python", default=os.environ.get("PROJECT_PYTHON", "python3"))
    ap.add_argument("--mode", choices=sorted(PEERS), default="full")
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-index", action="store_true",
                    help="also run the project with speculation's draft index kept in step (--speculative-algorithm "
                         "SUFFIX's cost to the tree), as project+draft-index")
    a = ap.parse_args()

    venv = os.path.dirname(os.path.dirname(sys.executable))
    trace = f"/tmp/prefix-trace-{a.requests}-{a.seed}.npz"
    if not os.path.exists(trace):
        subprocess.run([sys.executable, os.path.join(HERE, "trace.py"), trace, str(a.requests), str(a.seed)], check=True)

    results: dict[str, list[dict]] = {}
    for _ in range(a.rounds):
        for impl in PEERS[a.mode]:
            env = dict(os.environ)
            if impl in OLD:
                env["PYTHONPATH"] = os.path.join(venv, "sglang-0.5.20")
            cmd = [sys.executable, "-W", "ignore", os.path.join(HERE, "sglang_tree_ops.py"), impl, trace,
                   "--capacity", str(a.capacity)]
            r = run(cmd, env=env)
            results.setdefault(r["impl"], []).append(r)
        cmd = [a.project_python, "benchmarks/tree_ops.py", "--trace", trace, "--capacity", str(a.capacity),
               "--mode", a.mode, "--json"]
        r = run(cmd, cwd=a.project)
        results.setdefault("project", []).append(r)
        if a.draft_index:
            r = run(cmd + ["--draft-index"], cwd=a.project)
            results.setdefault("project+draft-index", []).append(r)

    med = {k: statistics.median(x["req_per_s"] for x in v) for k, v in results.items()}
    for k, v in results.items():
        print(f"{k:32s} req/s median {med[k]:>10,.0f}  hit_rate {v[0]['hit_rate']:.4f}  "
              f"evicted_tokens {v[0]['evicted_tokens']}")
    ours = [k for k in med if k.startswith("project")]
    for o in ours:
        for k in med:
            if k not in ours:
                print(f"ratio {o} / {k}: {med[o] / med[k]:.2f}")
    worst = min(med["project"] / med[k] for k in med if k not in ours)
    print(json.dumps({"mode": a.mode, "min_ratio_vs_peers": round(worst, 3),
                      "medians": {k: round(v, 1) for k, v in med.items()},
                      "hit_rates": {k: v[0]["hit_rate"] for k, v in results.items()}}))


if __name__ == "__main__":
    main()
