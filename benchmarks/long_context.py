"""One conversation growing to 8k, 16k and 32k tokens, served over HTTP by one engine at a
time (issue 30, section 2: long conversations, where a hybrid cache should shine): per
turn its depth, the cached tokens the server reports (hit rate), TTFT, decode time per
token, input tok/s and the server's resident memory; then rows at the depths asked for,
and one JSON line with everything.

    python benchmarks/long_context.py                        # uniradix, embedded preset
    python benchmarks/long_context.py --model-path /tmp/gemma-3-270m-q4_k_m.gguf
    python benchmarks/long_context.py --model-path /tmp/gemma-3-270m-q4_k_m.gguf \\
        --peers vllm,llamacpp --dtype bfloat16 --uniradix-args "--quantization stored"

The conversation: the first user turn holds about --turn-tokens tokens of deterministic
text (serve_vs_peers' word generator), each later turn adds the previous reply (its text,
stripped, as a chat client sends it back) and about --turn-tokens new user tokens to the
whole history, and asks for --output-tokens greedy tokens (end of turn ignored), until
the prompt reaches --max-context less the reply (capped by the engine's own context
length, /v1/models' max_model_len): prompt plus reply stay within --max-context. Words
per token are measured on each engine first (two warm-up prompts of 32 and 96 words;
their prompt token counts give the slope), so every turn's text is sized in that
engine's tokens; the last turn takes what room is left and the conversation ends when
less than a quarter turn is left.

Engines, one at a time, each started fresh, as serve_vs_peers.py starts them (its
`Running`, `command`: the same flags, pins and logs): `uniradix serve` (unless
--no-uniradix), then --peers from vllm, llamacpp where their venvs exist (a peer whose
venv or model is missing is skipped with the reason). Each is pinned to --server-cpus
(default: the last CPU this process may use; the client runs on the others) with one
compute thread; uniradix gets --max-total-tokens large enough for --max-context (more
flags with --uniradix-args) and the default prefill chunk (its size and the KV pools'
split are printed from the server). --model-path is a .gguf (uniradix reads it, llama.cpp
serves it, vLLM serves the float32 folder serve_vs_peers writes from it), a Hugging Face
folder (uniradix and vLLM; llama.cpp needs --gguf), or nothing: uniradix's embedded
preset (no peer can load it).

Requests stream through /v1/chat/completions (serve_vs_peers' request body). Per turn:
- depth: prompt tokens (usage.prompt_tokens; llama.cpp's from its log); added: its growth
  over the previous turn's (the previous reply, the new user text and their markup);
- cached: usage.prompt_tokens_details.cached_tokens (uniradix, vLLM), llama.cpp's
  `prefix-match hit` from its log; "n/a" where the engine reports none;
- TTFT: at the client, the request sent to the first chunk with text;
- decode ms/token: the median time between streamed chunks after the first (a chunk a
  token); where a chunk held several tokens (a byte tokenizer's characters), the reply's
  (last - first) / (chunks - 1) over the tokens per chunk instead;
- input tok/s: uncached prompt tokens / TTFT;
- RSS: VmRSS of the server process and every process below it (/proc), after the turn,
  and the peak sampled every 0.2 s during it.
Every process a run starts is stopped by its PID (and what it started, by theirs), on
errors and Ctrl-C too. The last line printed is the JSON (also --json FILE), with the
CPU's model and flags (memory_floor.cpu_info), the load and the date.
"""
from __future__ import annotations

import argparse
import datetime
import http.client
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

import memory_floor
import serve_vs_peers as peers

WARMUP_WORDS = (32, 96)       # two prompts whose token counts give tokens per word
DEPTHS = "8192,16384,32768"


# ------------------------------------------------------------------------------ the process
def pids_below(pid: int) -> list[int]:
    return [pid, *peers.descendants(pid)]


def rss_mib(pids: list[int]) -> float | None:
    """Resident memory of these processes together (VmRSS), MiB; None if none is there."""
    kib, seen = 0, False
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        kib += int(line.split()[1])
                        seen = True
                        break
        except (OSError, ValueError):
            continue
    return kib / 1024 if seen else None


class PeakRSS:
    """The highest RSS of `pids` sampled every `every` seconds while in the with-block."""

    def __init__(self, pids: list[int], every: float = 0.2) -> None:
        self.pids, self.every, self.peak = pids, every, None
        self._stop = threading.Event()

    def _run(self) -> None:
        while True:
            r = rss_mib(self.pids)
            if r is not None:
                self.peak = r if self.peak is None else max(self.peak, r)
            if self._stop.wait(self.every):
                return

    def __enter__(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


# ------------------------------------------------------------------------------ the client
def get_json(port: int, path: str, timeout: float = 30) -> dict | None:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("GET", path)
        r = c.getresponse()
        body = r.read()
        c.close()
        return json.loads(body) if r.status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return None


def stream_chat(port: int, body: dict, timeout: float) -> dict:
    """One streamed chat completion with the time of every chunk that carries text
    (serve_vs_peers.chat keeps only the first and last, and this needs the gaps)."""
    out = dict(text="", times=[], prompt_tokens=None, cached_tokens=None, completion_tokens=None, error=None)
    t0 = time.perf_counter()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = c.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return out
        parts = []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if msg.get("usage"):
                u = msg["usage"]
                out["prompt_tokens"] = u.get("prompt_tokens")
                out["completion_tokens"] = u.get("completion_tokens")
                out["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
            for ch in msg.get("choices") or []:
                text = (ch.get("delta") or {}).get("content") or ""
                if text:
                    out["times"].append(time.perf_counter() - t0)
                    parts.append(text)
        c.close()
        out["text"] = "".join(parts)
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    if out["completion_tokens"] is None:
        out["completion_tokens"] = len(out["times"])  # llama.cpp's stream has no usage: a chunk a token
    return out


def decode_ms(times: list[float], tokens: int) -> float | None:
    """Decode time per token from the chunks' arrival times (see the docstring)."""
    if len(times) < 2 or tokens < 2:
        return None
    if len(times) == tokens:
        return 1000 * statistics.median(b - a for a, b in itertools.pairwise(times))
    return 1000 * (times[-1] - times[0]) / (len(times) - 1) * len(times) / tokens


def reply_figures(srv, r: dict) -> dict:
    """Prompt and cached tokens of a reply: from its usage, or llama.cpp's log."""
    logged = srv.logged_requests(1)
    prompt, cached = r["prompt_tokens"], r["cached_tokens"]
    if logged and logged[0] is not None:
        cached, prompt = logged[0]
    return dict(prompt=prompt, cached=cached)


# ------------------------------------------------------------------------------ one engine
def turn_text(w: peers.Workload, words: int, turn: int) -> str:
    return w.text(max(1, words), "long-context", turn)


def run_engine(spec: peers.Server, a, eos_ids: list[int]) -> dict:
    log_path = os.path.join(a.log_dir, f"{spec.name}.log")
    srv = peers.Running(spec, a, log_path)
    pid = srv.proc.pid
    res = dict(engine=spec.name, pid=pid, pids=[pid], log=log_path, turns=[])
    print(f"\n{spec.name}: starting (pid {pid}, pinned to CPU {a.server_cpus or 'none'}; log {log_path})",
          flush=True)
    try:
        t0 = time.perf_counter()
        srv.wait_ready(a.start_timeout)
        res["start_s"] = time.perf_counter() - t0
        res["pids"] = pids_below(pid)
        models = get_json(srv.port, "/v1/models") or {}
        reported = next((m.get("max_model_len") for m in models.get("data") or []), None)
        context = reported or (a.context if spec.kind != "uniradix" else None)
        res["context_length"] = context
        res["cap"] = cap = (min(a.max_context, context) if context else a.max_context) - a.output_tokens
        if spec.kind == "uniradix":
            info = get_json(srv.port, "/get_server_info") or {}
            res["server"] = {k: info.get(k) for k in ("chunked_prefill_size", "max_total_tokens", "page_size",
                                                      "swa_full_tokens_ratio", "dtype", "quantization")}
            pools = [ln.split(" INFO ", 1)[-1] for ln in srv.log_tail(20000).splitlines() if "KV pools" in ln]
            res["server"]["kv_pools"] = pools[0] if pools else None
            print(f"  prefill chunk {info.get('chunked_prefill_size')} tokens; "
                  f"{res['server']['kv_pools'] or 'KV pools: not in the log'}")
        # warm-up, and tokens per word on this engine's tokenizer
        w = peers.Workload(output_tokens=a.output_tokens, seed=a.seed)
        probe = []
        for n in WARMUP_WORDS:
            r = stream_chat(srv.port, peers.request_body(spec, [{"role": "user", "content": turn_text(w, n, -n)}],
                                                         peers.Workload(output_tokens=4), eos_ids),
                            a.request_timeout)
            if r["error"]:
                raise RuntimeError(f"warm-up failed: {r['error']}")
            probe.append(reply_figures(srv, r)["prompt"])
        srv.new_log()
        if None in probe or probe[1] <= probe[0]:
            raise RuntimeError(f"the engine reported no prompt token counts for the warm-up ({probe})")
        per_word = (probe[1] - probe[0]) / (WARMUP_WORDS[1] - WARMUP_WORDS[0])
        res["tokens_per_word"] = per_word
        print(f"  ready in {res['start_s']:.0f} s; context {context or 'unbounded'}, conversation to "
              f"{cap:,} prompt tokens; {per_word:.2f} tokens a word; {peers.load_note()}")
        print(f"{'turn':>4} {'depth':>7} {'added':>6} {'cached':>7} {'hit rate':>8} {'TTFT s':>7} "
              f"{'decode ms/tok':>13} {'input tok/s':>11} {'RSS MiB':>8} {'peak MiB':>8}", flush=True)
        messages: list[dict] = []
        prev_prompt, extra = 0, a.output_tokens + 16  # extra: what a turn adds besides its words
        turn = 0
        while True:
            turn += 1
            room = cap - prev_prompt - (extra if turn > 1 else 16)
            if room < a.turn_tokens / 4:
                break
            last = room < a.turn_tokens
            words = int((room * 0.95 if last else a.turn_tokens) / per_word)
            messages.append({"role": "user", "content": turn_text(w, words, turn)})
            body = peers.request_body(spec, messages, w, eos_ids)
            res["pids"] = sorted(set(res["pids"]) | set(pids_below(pid)))
            with PeakRSS(res["pids"]) as peak:
                r = stream_chat(srv.port, body, a.request_timeout)
            if r["error"]:
                res["error"] = f"turn {turn}: {r['error']}"
                print(f"  turn {turn} failed: {r['error']}", flush=True)
                break
            fig = reply_figures(srv, r)
            p, c = fig["prompt"], fig["cached"]
            ttft = r["times"][0] if r["times"] else None
            row = dict(turn=turn, depth=p, added=p - prev_prompt if p is not None else None, cached=c,
                       hit=c / p if p and c is not None else None, ttft_s=ttft,
                       decode_ms=decode_ms(r["times"], r["completion_tokens"]),
                       input_tps=(p - c) / ttft if p is not None and c is not None and ttft else None,
                       completion_tokens=r["completion_tokens"], rss_mib=rss_mib(res["pids"]),
                       rss_peak_mib=peak.peak, words=words)
            res["turns"].append(row)
            print_turn(row, flush=True)
            if p is None:
                res["error"] = f"turn {turn}: the engine reported no prompt tokens"
                break
            if turn > 1:
                extra = max(0, p - prev_prompt - round(words * per_word))
            prev_prompt = p
            messages.append({"role": "assistant", "content": r["text"].strip()})
            if last:
                break
    except RuntimeError as e:
        res["error"] = str(e)
        print(f"  {spec.name} FAILED: {str(e)[-800:]}", flush=True)
    finally:
        srv.stop()
    res["summary"] = summary(res["turns"], a.depths, a.turn_tokens)
    return res


# ------------------------------------------------------------------------------ figures
def fmt(x, kind: str) -> str:
    if x is None:
        return "n/a"
    return {"int": f"{x:,}", "hit": f"{x:.1%}", "s": f"{x:.2f}", "ms": f"{x:.1f}", "tps": f"{x:,.0f}",
            "mib": f"{x:,.0f}"}[kind]


def print_turn(row: dict, flush: bool = False, label: str | None = None) -> None:
    print(f"{label or row['turn']:>4} {fmt(row['depth'], 'int'):>7} {fmt(row['added'], 'int'):>6} "
          f"{fmt(row['cached'], 'int'):>7} {fmt(row['hit'], 'hit'):>8} {fmt(row['ttft_s'], 's'):>7} "
          f"{fmt(row['decode_ms'], 'ms'):>13} {fmt(row['input_tps'], 'tps'):>11} {fmt(row['rss_mib'], 'mib'):>8} "
          f"{fmt(row['rss_peak_mib'], 'mib'):>8}", flush=flush)


def summary(turns: list[dict], depths: list[int], turn_tokens: int) -> list[dict]:
    """For each depth, the turn nearest it, if one came within half a turn of it."""
    out = []
    for d in depths:
        near = min((t for t in turns if t["depth"] is not None), key=lambda t: abs(t["depth"] - d), default=None)
        if near is not None and abs(near["depth"] - d) <= turn_tokens / 2:
            out.append(dict(target=d, **near))
        else:
            out.append(dict(target=d, turn=None, deepest=max((t["depth"] or 0 for t in turns), default=0)))
    return out


def print_summary(results: list[dict]) -> None:
    print(f"\n{'engine':<12} {'depth':>6} {'turn':>4} {'tokens':>7} {'hit rate':>8} {'TTFT s':>7} "
          f"{'decode ms/tok':>13} {'input tok/s':>11} {'RSS MiB':>8} {'peak MiB':>8}")
    for res in results:
        for row in res["summary"]:
            d = row["target"]
            head = f"{res['engine']:<12} {f'{d // 1024}k' if d % 1024 == 0 else f'{d:,}':>6}"
            if row["turn"] is None:
                print(f"{head} {'-':>4} not reached (deepest {row['deepest']:,})")
                continue
            print(f"{head} {row['turn']:>4} {fmt(row['depth'], 'int'):>7} {fmt(row['hit'], 'hit'):>8} "
                  f"{fmt(row['ttft_s'], 's'):>7} {fmt(row['decode_ms'], 'ms'):>13} {fmt(row['input_tps'], 'tps'):>11} "
                  f"{fmt(row['rss_mib'], 'mib'):>8} {fmt(row['rss_peak_mib'], 'mib'):>8}")


# ------------------------------------------------------------------------------ main
def engines(a) -> tuple[list[peers.Server], list[str]]:
    """The servers to run, and a note for each one skipped."""
    path = a.model_path
    gguf = path if path and path.endswith(".gguf") else a.gguf
    a.gguf = gguf
    if path and not path.endswith(".gguf"):
        a.f32_dir = path  # a Hugging Face folder: uniradix and vLLM serve it as it is
    model = "embedded" if path is None else ("gguf" if path.endswith(".gguf") else "f32")
    budget = max(16384, -(-(a.max_context + a.output_tokens + 512) // 1024) * 1024)
    out, skipped = [], []
    if not a.no_uniradix:
        out.append(peers.Server("uniradix", "uniradix", a.dtype, model=model,
                                extra=("--max-total-tokens", str(budget))))
    for name in [p for p in a.peers.split(",") if p]:
        if name not in ("vllm", "llamacpp"):
            raise SystemExit(f"unknown peer {name!r}: vllm or llamacpp")
        py = a.vllm_python if name == "vllm" else a.llamacpp_python
        if not os.path.exists(py):
            skipped.append(f"skipping {name}: no {py} (benchmarks/serve_vs_peers.py's docstring says how to make it)")
        elif path is None:
            skipped.append(f"skipping {name}: the embedded preset is uniradix's own (give --model-path)")
        elif name == "llamacpp" and not gguf:
            skipped.append("skipping llamacpp: it serves a .gguf (give --gguf or a .gguf --model-path)")
        else:
            out.append(peers.Server(name, name, a.dtype, model="gguf" if name == "llamacpp" else "f32"))
    return out, skipped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", default=None,
                    help="a .gguf or a Hugging Face folder (default: uniradix's embedded preset)")
    ap.add_argument("--dtype", default="float32", help="uniradix's and vLLM's --dtype")
    ap.add_argument("--turn-tokens", type=int, default=1900, help="new user tokens a turn")
    ap.add_argument("--output-tokens", type=int, default=32, help="greedy tokens a reply")
    ap.add_argument("--max-context", type=int, default=32768, help="prompt plus reply, at most")
    ap.add_argument("--depths", default=DEPTHS, help="the summary's depths, tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers", default="", help="comma list from vllm, llamacpp (run after uniradix)")
    ap.add_argument("--no-uniradix", action="store_true", help="the peers alone")
    ap.add_argument("--gguf", default=None, help="llama.cpp's file when --model-path is a folder")
    peers.add_server_args(ap, vllm_kv_gib=4, request_timeout=1800)
    ap.add_argument("--json", default=None, help="also write the JSON line here")
    a = ap.parse_args(argv)
    a.depths = [int(x) for x in a.depths.split(",") if x]
    a.context = a.max_context  # vLLM's --max-model-len, llama.cpp's --n_ctx (serve_vs_peers.command)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the running server is stopped on the way out
    peers.pin_servers(a)
    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="long_context-")
    os.makedirs(a.log_dir, exist_ok=True)
    specs, skipped = engines(a)
    for note in skipped:
        print(note)
    eos_ids: list[int] = []  # llama.cpp takes no ignore_eos: its end ids get a -100 bias (request_body)
    if any(s.kind == "vllm" for s in specs) and a.model_path.endswith(".gguf"):
        eos_ids = peers.f32_folder(a.gguf, a.f32_dir)  # vLLM's float32 folder, written once
    if any(s.kind == "llamacpp" for s in specs) and not eos_ids:
        from uniradix.model.hf.gguf import read_gguf
        eos_ids = list(read_gguf(a.gguf).generation["eos_token_id"])
    cpu = memory_floor.cpu_info()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"one conversation: ~{a.turn_tokens} new tokens a turn, {a.output_tokens} output tokens, to "
          f"{a.max_context:,} tokens; model {a.model_path or 'embedded preset'}; {date}\n"
          f"CPU {memory_floor.describe_cpu(cpu)}; {peers.load_note()}", flush=True)
    results = []
    try:
        for s in specs:
            results.append(run_engine(s, a, eos_ids))
    except KeyboardInterrupt:  # run_engine has stopped its server on the way out
        print("\ninterrupted; the server was stopped", flush=True)
        return 130
    print_summary(results)
    print(f"\n{peers.load_note()} at the end")
    record = dict(benchmark="long_context", date=date, cpu=cpu, cpu_line=memory_floor.describe_cpu(cpu),
                  load_end=peers.load_note(), skipped=skipped,
                  settings=dict(model_path=a.model_path, dtype=a.dtype, turn_tokens=a.turn_tokens,
                                output_tokens=a.output_tokens, max_context=a.max_context, depths=a.depths,
                                server_cpus=a.server_cpus, uniradix_args=a.uniradix_args, seed=a.seed),
                  engines=results)
    line = json.dumps(record)
    if a.json:
        with open(a.json, "w") as fh:
            fh.write(line + "\n")
    print(line, flush=True)
    return 0 if results and any(r["turns"] and "error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
