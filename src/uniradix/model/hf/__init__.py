"""Real hybrid models from Hugging Face checkpoints (config.json + safetensors +
tokenizer.json, or a GGUF file), each a paged forward over the cache's pools, exact
against `transformers`' own implementation (which is a test dependency only)."""
from __future__ import annotations

import os

import torch

from .checkpoint import Checkpoint, read_checkpoint
from .family import HFModel
from .gemma3 import Gemma3

FAMILIES: list[type[HFModel]] = [Gemma3]


def supported() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)


def family_for(ckpt: Checkpoint) -> type[HFModel]:
    mt = ckpt.model_type
    for f in FAMILIES:
        if mt in f.model_types:
            return f
    raise ValueError(f"{ckpt.path}: architecture {mt!r} ({', '.join(ckpt.get('architectures') or [])}) is not "
                     f"supported; supported: {', '.join(supported())}")


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> HFModel:
    """A checkpoint directory, or a .gguf file, as a PagedModel."""
    if path.endswith(".gguf") and os.path.isfile(path):
        from .gguf import read_gguf
        ckpt = read_gguf(path, dtype)
    else:
        ckpt = read_checkpoint(path, dtype)
    return family_for(ckpt)(ckpt, dtype)


__all__ = ["FAMILIES", "HFModel", "Checkpoint", "read_checkpoint", "load_checkpoint", "supported"]
