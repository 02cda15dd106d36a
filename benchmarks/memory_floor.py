"""The memory floor of a decode step, measured on the machine at hand: what the CPU is
(its model name and the flags that decide which kernels are fast), how fast it reads
memory, and how many bytes a step must read. A batch-1 decode step reads every weight it
multiplies by once, so it can take no less than bytes / bandwidth (issue 30: measure the
floor in the same run as the decode, always; the neighbours' load moves it).

Used by benchmarks/decode_step.py; importable by any benchmark run from this folder."""
from __future__ import annotations

import math
import time

import torch

#: the flags that decide which kernels are fast here (gemm.fast_cpu_gemm, kernels.c's ISA)
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
    """{"model": the CPU's model name, "flags": {flag: present} for CPU_FLAGS} (empty
    where Linux's cpuinfo is not there)."""
    name, flags = "", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": name or "unknown CPU", "flags": {f: f in flags for f in CPU_FLAGS}}


def describe_cpu(info: dict) -> str:
    has = [f for f, on in info["flags"].items() if on]
    lacks = [f for f, on in info["flags"].items() if not on]
    return f"{info['model']}: {' '.join(has) or '(none of them)'}" + (f"; no {' '.join(lacks)}" if lacks else "")


def bandwidth(mb: int = 512, threads: int | None = None, repeats: int = 5) -> dict:
    """Memory bandwidth in GB/s (1e9 bytes) with `threads` torch threads (the process's
    affinity applies, so pinned as the run is): "read", a torch sum over an `mb` MB
    float32 buffer (the floor's: a decode step streams weights and writes little), and
    "copy", bytes read plus bytes written by a plain copy of it (a reference; it also pays
    for the writes); each the best of `repeats`."""
    n = mb * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32).fill_(1.0)  # touched: its pages exist before timing
    dst = torch.empty_like(src).fill_(0.0)
    prev = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        read = copy = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            src.sum()
            read = min(read, time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(src)
            copy = min(copy, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    nbytes = src.numel() * src.element_size()
    return {"read": nbytes / read / 1e9, "copy": 2 * nbytes / copy / 1e9, "threads": threads or prev}


def nbytes(obj) -> int:
    """The bytes a weight occupies in the form the forward multiplies by: a tensor's (a
    oneDNN-packed one too); a kernels.PackedWeight's nbytes() (its panels); an expert
    stack's experts; a quantized weight's tensors (codes and scales); 0 for what is not a
    weight."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if callable(getattr(obj, "nbytes", None)):
        return int(obj.nbytes())
    experts = getattr(obj, "experts", None)
    if isinstance(experts, (list, tuple)):
        return sum(nbytes(e) for e in experts)
    if callable(getattr(obj, "tensors", None)):
        t = obj.tensors()
        return sum(nbytes(x) for x in (t.values() if isinstance(t, dict) else [t]))
    return 0


def _leaves(w, name: str = ""):
    if isinstance(w, dict):
        for k, v in w.items():
            yield from _leaves(v, f"{name}.{k}" if name else str(k))
    elif isinstance(w, (list, tuple)):
        for i, v in enumerate(w):
            yield from _leaves(v, f"{name}.{i}")
    else:
        yield name, w


def _itemsize(dtype) -> int:
    return (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize


def step_bytes(model, batch: int, depth: int, greedy: bool = True) -> dict:
    """The bytes a decode step of `batch` requests, each `depth` tokens deep, must read:
    "weights": every weight the step multiplies by (norms included) at its size in memory,
    once however many names it has, the head as the step reads it (a tied head's packed
    or quantized copy, or the embedding table itself; for greedy rows, where the model
    has one, the greedy head's int8 copy, kernels.GreedyHead: the few panels it then
    computes exactly are not counted); "embedding":
    the rows of the embedding table the step looks up (one per request: the table itself
    counts only where it is the head); "kv": the keys and values each attention layer
    reads (its window's at most, the query's own key included); "states": the recurrent
    layers' states read. An expert stack counts whole (a MoE step reads only its routed
    experts: there this floor is an upper bound)."""
    embed_name = getattr(model, "embed_weight", "embed")
    head = getattr(model, "lm_head", None)
    counted = set()  # one object under two names (a head tied to the embedding's very panels) is read once
    weights = embedding = 0
    for name, w in _leaves(model.weights):
        if name == embed_name and w is not head:
            shape = getattr(w, "shape", ())
            embedding = batch * nbytes(w) // shape[0] if len(shape) == 2 and shape[0] else 0
        elif id(w) not in counted and w is not head:
            counted.add(id(w))
            weights += nbytes(w)
    fast = model.greedy_head() if greedy and callable(getattr(model, "greedy_head", None)) else None
    if fast is not None:
        weights += fast.nbytes()
    elif head is not None:
        weights += nbytes(head)  # in the weights dict or outside it (a tied head's packed or quantized copy)
    kv = states = 0
    for _spec, layer_states in model.states().groups:
        for ls in layer_states:
            s = ls.shape
            if hasattr(s, "num_kv_heads"):
                window = getattr(_spec, "window", None)
                keys = depth + 1 if window is None else min(depth + 1, window)
                kv += 2 * keys * s.num_kv_heads * s.head_dim * _itemsize(s.dtype)
            elif hasattr(s, "state_shape"):
                states += math.prod(s.state_shape) * _itemsize(s.state_dtype) \
                    + math.prod(s.conv_shape) * _itemsize(s.conv_dtype)
    kv, states = batch * kv, batch * states
    return {"weights": weights, "embedding": embedding, "kv": kv, "states": states,
            "total": weights + embedding + kv + states}


def floor_ms(total_bytes: int, gb_per_s: float) -> float:
    return total_bytes / (gb_per_s * 1e9) * 1e3
