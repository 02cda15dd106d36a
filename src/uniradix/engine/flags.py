"""An Engine from command-line flags: the flags `uniradix run` and `uniradix serve` share
(generated from uniradix.config), the compute threads they set, and the engine with its
L3 backend. Below both the CLI and the server, so that neither imports the other."""
from __future__ import annotations

import argparse
import os
import time


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, cache, tier and scheduler flags, generated from uniradix.config."""
    from ..config import CacheConfig, ComputeSettings, HostTierConfig, ModelSettings, SchedulerConfig, \
        SpeculativeConfig, StorageConfig, add_flags
    from ..model import PRESETS
    add_flags(p, ModelSettings, "model", choices={"model_preset": sorted(PRESETS)})
    add_flags(p, ComputeSettings, "compute")
    add_flags(p, CacheConfig, "device cache (SGLang's flag names)")
    add_flags(p, SchedulerConfig, "scheduler")
    add_flags(p, SpeculativeConfig, "speculative decoding (SGLang's and vLLM's flag names)")
    add_flags(p, HostTierConfig, "host tier (L2)")
    add_flags(p, StorageConfig, "shared storage (L3)")


def threads_from_args(a: argparse.Namespace) -> str:
    """Apply --num-threads (else $OMP_NUM_THREADS, else one: uniradix.threads) before
    anything computes; the start-up line that says it, and which kernels the forward
    runs on (the row-invariant ones, built here on first use, or torch's, and why).
    ValueError on a bad value."""
    from ..config import ComputeSettings, from_args
    from ..model import kernels
    from ..threads import start_threads
    return f"{start_threads(from_args(ComputeSettings, a).num_threads)}, {kernels.describe()}"


def pools_line(engine) -> str:
    """The start-up line of an engine's KV pools: how the budget is split (engine.build)."""
    from .build import describe_split, kv_split
    return describe_split(kv_split(engine.model, engine.config.cache, max_running=engine.max_running,
                                   chunk=engine.chunk, context_length=engine.context_length))


def loaded_line(model, path: str, seconds: float) -> str:
    """What was loaded from a checkpoint, how long it took and what its weights hold in
    memory (model.hf.weights_nbytes: packed and quantized forms as held, a tied head
    once)."""
    from ..model.hf.weights_forms import weights_nbytes
    from .build import size_text
    return (f"loaded {model.name} from {path} in {seconds:.1f} s: {size_text(weights_nbytes(model.weights))} "
            "of weights in memory")


def engine_from_args(a: argparse.Namespace, say=None):
    """An Engine from the flags (it opens the L3 backend they name: a store that cannot
    be reached is StorageUnavailable, unless allow_unavailable_at_start). `say` hears
    what is being loaded and, once it is, how long it took and its size (a checkpoint
    takes up to minutes: nobody should wonder whether the process hangs)."""
    from ..config import engine_config_from_args
    from ..model import preset
    from .engine import Engine
    config = engine_config_from_args(a)
    path = a.model_path
    if path is not None and (os.path.isdir(path) or path.endswith(".gguf")):
        import torch

        from ..model.hf import load_checkpoint
        if say:
            size = os.path.getsize(path) if os.path.isfile(path) else sum(
                e.stat().st_size for e in os.scandir(path) if e.is_file())
            from .build import size_text
            say(f"loading {path} ({size_text(size)} on disk) in {a.dtype}"
                + ("" if a.quantization == "none" else f", linear weights {a.quantization}"))
        t0 = time.perf_counter()
        model, weights = load_checkpoint(path, getattr(torch, a.dtype), a.quantization), None
        if say:
            say(loaded_line(model, path, time.perf_counter() - t0))
    else:  # the embedded model, seeded or with a safetensors file of weights
        if a.quantization != "none":
            raise ValueError(f"--quantization {a.quantization} applies to a checkpoint (--model-path DIR or "
                             "model.gguf), not to the embedded model")
        model, weights = preset(a.model_preset), path
    return Engine(model, config, weights=weights)  # it opens the L3 backend the settings name
