"""A realistic request log, as `uniradix serve --request-log PATH --log-token-ids` writes
it, of any length: one `start` line (the settings in force), then one line per finished
request in the order requests finished, and a `close_session` line when a conversation
ends. The traffic: `--clients` conversations at a time, each of a few turns (a tenant's
system prompt, then each turn the whole history plus a new message), a few tenants
(cache salts), replies of varied length, now and then a request that failed or was
aborted. It is the input of `benchmarks/log_tools.py` (how fast and in how much memory
`uniradix hit-rate` and `uniradix simulate` read and replay a 10^6-line log) and of the
slow tests of tests/bench/test_log_records.py. Written as it is made: constant memory.

    python benchmarks/request_log_gen.py OUT.jsonl [--lines 1000000] [--clients 32] [--seed 0]
"""
from __future__ import annotations

import argparse
import heapq
import json
import random
import sys

from uniradix.config import EngineConfig

VOCAB = 256  # the embedded presets' vocabulary
T0 = 1796228643.0  # 2026-12-02 (Unix seconds)


def settings(preset: str, max_total_tokens: int, clients: int) -> dict:
    """The start line's settings, as `uniradix serve` writes them."""
    cfg = EngineConfig.of(max_total_tokens=max_total_tokens, max_running_requests=clients)
    return {**cfg.as_dict(), "model_path": None, "model_preset": preset, "dtype": None, "quantization": None,
            "context_length": None, "num_threads": 1, "vocab_size": VOCAB}


class Client:
    """One client: conversations one after another, each of 1-`turns` turns."""

    def __init__(self, lane: int, rng: random.Random, tenants: list, turns: int) -> None:
        self.lane, self.rng, self.tenants, self.turns = lane, rng, tenants, turns
        self.clock = T0 + rng.random()
        self.n = 0
        self._new_conversation()

    def _new_conversation(self) -> None:
        rng = self.rng
        self.n += 1
        self.session = f"c{self.lane}-{self.n}"
        self.salt, system = rng.choice(self.tenants)
        self.history = system + [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 16))]
        self.left = rng.randrange(1, self.turns + 1)
        self.cached = 0

    def next(self) -> list[dict]:
        """The lines this client's next request writes (its record, then a close if the
        conversation ends with it), in time order."""
        rng = self.rng
        ids = self.history
        out = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 16))]
        arrival = self.clock + rng.expovariate(2.0)
        ttft = 0.01 + 0.0002 * (len(ids) - self.cached)
        latency = ttft + 0.008 * len(out)
        status = "finished"
        roll = rng.random()
        if roll < 0.003:
            status, out = "aborted", out[:rng.randrange(len(out))]
        elif roll < 0.005:
            status, out = "error", []
        finish = arrival + latency
        rec = {"time": round(finish, 6), "rid": f"{self.session}-{rng.getrandbits(32):08x}", "session": self.session,
               "status": status, "finish_reason": None if status != "finished" else rng.choice(("length", "stop")),
               "prompt_tokens": len(ids), "cached_tokens": self.cached, "cached_device": self.cached,
               "cached_host": 0, "cached_storage": 0, "cached_cross_instance": 0,
               "computed_tokens": len(ids) - self.cached, "output_tokens": len(out),
               "ttft": round(ttft, 6), "latency": round(latency, 6), "input_ids": ids, "output_ids": out,
               "salt": self.salt, "priority": None, "prompt_logprobs_from": None}
        lines = [rec]
        self.clock = finish
        self.left -= 1
        if status == "finished" and self.left > 0:
            self.cached = len(ids) + len(out) - 1
            self.history = ids + out + [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 12))]
        else:
            self.clock += 0.001
            lines.append({"time": round(self.clock, 6), "event": "close_session", "session": self.session,
                          "salt": self.salt})
            self._new_conversation()
        return lines


def write(path: str, lines: int, clients: int = 32, turns: int = 5, seed: int = 0, preset: str = "tiny-hybrid",
          max_total_tokens: int = 16384) -> int:
    """Write a log of `lines` lines at `path`; returns its size in bytes."""
    rng = random.Random(seed)
    tenants = [(None if t == 0 else f"{rng.getrandbits(64):016x}", [rng.randrange(VOCAB) for _ in range(16)])
               for t in range(4)]
    pending: list = []  # (time, order, client, line): what clients wrote, merged in time order
    queued = [0] * clients
    order = 0
    cs = [Client(i, random.Random(rng.getrandbits(64)), tenants, turns) for i in range(clients)]

    def more(c: Client) -> None:
        nonlocal order
        for line in c.next():
            heapq.heappush(pending, (line["time"], order, c.lane, line))
            queued[c.lane] += 1
            order += 1
    for c in cs:
        more(c)
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        first = json.dumps({"time": T0, "event": "start", "settings": settings(preset, max_total_tokens, clients)})
        f.write(first + "\n")
        size += len(first) + 1
        written = 1
        while written < lines:
            _, _, lane, line = heapq.heappop(pending)
            text = json.dumps(line) + "\n"
            f.write(text)
            size += len(text)
            written += 1
            queued[lane] -= 1
            if not queued[lane]:  # the client's lines are out: its next request
                more(cs[lane])
    return size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--clients", type=int, default=32, help="conversations at a time")
    p.add_argument("--turns", type=int, default=5, help="the most turns of a conversation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-preset", default="tiny-hybrid")
    p.add_argument("--max-total-tokens", type=int, default=16384)
    a = p.parse_args()
    size = write(a.out, a.lines, a.clients, a.turns, a.seed, a.model_preset, a.max_total_tokens)
    print(f"{a.out}: {a.lines:,} lines, {size / 1e6:.1f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
