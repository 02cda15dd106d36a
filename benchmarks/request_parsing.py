"""How long the server takes to turn a request body into the engine's requests, for each
of the three generation routes: the functions the routes call, `parse_json` on the raw
bytes (read_body) and then `parse_generate`, `parse_completion` or `parse_chat`, on
small and large bodies that carry sampling parameters. `json.loads` of the same bytes is
timed in the same run, as the baseline the ratios are against.

    python benchmarks/request_parsing.py [--batches 300] [--json]

It measures the code it imports (`uniradix.server.protocol`, whose path it prints), so
two trees compare by running it against each (PYTHONPATH=OTHER/src), on the same quiet
core, interleaved. Each figure is the fastest of many short batches, in microseconds a
body.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import time

from uniradix.server import protocol
from uniradix.server.protocol import parse_chat, parse_completion, parse_generate, parse_json

EOS = (2,)
MAX_BATCH = 64
SGLANG_SAMPLING = {"max_new_tokens": 256, "temperature": 0.7, "top_p": 0.95, "top_k": 40, "ignore_eos": False,
                   "stop": ["\n\nUser:", "</s>"], "stop_token_ids": [7, 9], "skip_special_tokens": True,
                   "min_p": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}
OPENAI_SAMPLING = {"model": "tiny-hybrid", "max_tokens": 256, "temperature": 0.7, "top_p": 0.95, "seed": 7,
                   "stop": ["\n\nUser:"], "n": 1, "presence_penalty": 0, "frequency_penalty": 0,
                   "stream": True, "stream_options": {"include_usage": True}, "user": "bench"}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(("cache", "prefix", "window", "state", "token", "layer", "radix", "page"))
                    for _ in range(n))


def bodies(seed: int = 0) -> dict[str, tuple]:
    """{case: (route's parser, raw body)}: what SGLang's bench_serving and OpenAI's
    clients send, small (a short prompt) and large (a long one: 16k token ids, 64 KB of
    text, a 64-message conversation)."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, 50_000) for _ in range(16_384)]
    text = words(rng, 9_000)
    chat = [{"role": ("user", "assistant")[i % 2], "content": words(rng, 150)} for i in range(64)]
    cases = {
        "generate text, small": (
            "generate", {"text": "Summarize the cache's rules.", "sampling_params": SGLANG_SAMPLING, "stream": True,
                         "rid": "r-1", "return_logprob": False, "log_metrics": True, "lora_path": None}),
        "generate ids, large": (
            "generate", {"input_ids": ids, "sampling_params": SGLANG_SAMPLING, "stream": False, "rid": "r-2",
                         "cache_salt": "tenant-a", "extra_key": "k"}),
        "generate batch of 8": (
            "generate", {"text": [words(rng, 40) for _ in range(8)], "sampling_params": SGLANG_SAMPLING}),
        "completion, small": ("completion", {"prompt": "Once upon a time", **OPENAI_SAMPLING, "logprobs": 2}),
        "completion, large": ("completion", {"prompt": text, **OPENAI_SAMPLING}),
        "completion ids, large": ("completion", {"prompt": ids, **OPENAI_SAMPLING}),
        "chat, small": ("chat", {"messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "What is a radix tree?"}],
                                 **OPENAI_SAMPLING, "logprobs": True, "top_logprobs": 2, "tool_choice": "none"}),
        "chat, large": ("chat", {"messages": chat, **OPENAI_SAMPLING, "max_completion_tokens": 128}),
    }
    return {k: (kind, json.dumps(b).encode()) for k, (kind, b) in cases.items()}


def parser(kind: str):
    if kind == "generate":
        return lambda body: parse_generate(body, EOS, MAX_BATCH)
    if kind == "completion":
        return lambda body: parse_completion(body, EOS, MAX_BATCH)
    return lambda body: parse_chat(body, EOS)


def best(fn, arg, batches: int) -> float:
    """Microseconds a call of fn(arg): the fastest of `batches` batches of about a
    millisecond each (short, so that on a shared core some batch runs without being
    preempted: the fastest is the code's own cost)."""
    fn(arg)  # warm
    t = time.perf_counter()
    fn(arg)
    n = max(1, int(1e-3 / max(time.perf_counter() - t, 1e-7)))
    out = float("inf")
    gc.collect()
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(n):
            fn(arg)
        out = min(out, (time.perf_counter() - t) / n)
    return out * 1e6


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=300, help="batches of about 1 ms a case and measure; the "
                                                              "fastest is reported")
    ap.add_argument("--json", action="store_true", help="one JSON line at the end")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}; Python {platform.python_version()}")
    print(f"protocol: {protocol.__file__}")
    print(f"{'case':24} {'bytes':>8} {'json.loads':>11} {'parse':>10} {'json+parse':>11} {'/ json.loads':>13}")
    results = {}
    for case, (kind, raw) in bodies().items():
        parse = parser(kind)
        body = json.loads(raw)
        loads = best(json.loads, raw, args.batches)
        only = best(parse, body, args.batches)
        route = best(lambda r: parse(parse_json(r)), raw, args.batches)
        results[case] = {"bytes": len(raw), "json_loads_us": round(loads, 2), "parse_us": round(only, 2),
                         "json_and_parse_us": round(route, 2)}
        print(f"{case:24} {len(raw):8d} {loads:9.1f}us {only:8.1f}us {route:9.1f}us {route / loads:12.2f}x")
    print("parse: the route's parse_* on the decoded body; json+parse: parse_json (the body reader's) then "
          "parse_*, what a request costs before the engine sees it")
    if args.json:
        print(json.dumps({"cpu": cpu_model(), "protocol": protocol.__file__, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
