"""Real hybrid models from Hugging Face checkpoints (config.json + safetensors +
tokenizer.json, or a GGUF file), each a paged forward over the cache's pools, exact
against `transformers`' own implementation (which is a test dependency only)."""
from __future__ import annotations

import os

import torch

import importlib
import importlib.util

from .checkpoint import Checkpoint, read_checkpoint
from .family import HFModel
from .quant import check_scheme

#: one module per family (model/hf/<module>.py), each with one HFModel subclass
FAMILY_MODULES = {"qwen3": "Qwen3", "gemma3": "Gemma3", "qwen3_next": "Qwen3Next", "gpt_oss": "GptOss",
                  "granite_hybrid": "GraniteHybrid", "nemotron_h": "NemotronH"}


def families() -> list[type[HFModel]]:
    out = []
    for module, cls in FAMILY_MODULES.items():
        if importlib.util.find_spec(f"{__name__}.{module}") is not None:
            out.append(getattr(importlib.import_module(f"{__name__}.{module}"), cls))
    return out


def supported() -> list[str]:
    return sorted(t for f in families() for t in f.model_types)


def family_for(ckpt: Checkpoint) -> type[HFModel]:
    try:
        return family_for_config(ckpt.config)
    except ValueError as e:
        raise ValueError(f"{ckpt.path}: {e}") from None


def family_for_config(config: dict) -> type[HFModel]:
    """The family that serves a (text) config by its model_type."""
    mt = config.get("model_type", "?")
    for f in families():
        if mt in f.model_types:
            return f
    raise ValueError(f"architecture {mt!r} ({', '.join(config.get('architectures') or [])}) is not "
                     f"supported; supported: {', '.join(supported())}")


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype = torch.float32, quantization: str = "none") -> HFModel:
    """A checkpoint directory, or a .gguf file (a str or a path object), as a PagedModel
    in `dtype`, its linear weights quantized as `quantization` says (quant.SCHEMES: none,
    int8, int4, stored)."""
    check_scheme(quantization)
    path = os.fspath(path)
    if path.endswith(".gguf") and os.path.isfile(path):
        from .gguf import read_gguf
        ckpt = read_gguf(path, dtype)
    else:
        ckpt = read_checkpoint(path, dtype)
    model = family_for(ckpt)(ckpt, dtype).quantize(quantization).pack_linears()
    model.greedy_head()   # built now where it pays, not in the first greedy request's time
    return model


__all__ = ["FAMILY_MODULES", "families", "family_for_config", "HFModel", "Checkpoint", "read_checkpoint",
           "load_checkpoint", "supported"]
