"""A model from what a user names (above `base` and `hf`, which it chooses between, so
that neither imports the other)."""
from __future__ import annotations

import os

from .base import PagedModel, ReferenceModel
from .config import HybridConfig


def load_model(model, weights=None) -> PagedModel:
    """A model from what a user names: a PagedModel as it is; a preset name or a
    HybridConfig (the embedded model; `weights`: a dict or a safetensors file for it); a
    checkpoint directory (config.json, safetensors, tokenizer.json) or a .gguf file."""
    if isinstance(model, PagedModel):
        if weights is not None:
            raise ValueError("weights go with a model config, not with a loaded model")
        return model
    if isinstance(model, HybridConfig):
        return ReferenceModel(model, weights)
    if isinstance(model, str) and not os.path.exists(model):
        return ReferenceModel(model, weights)  # a preset name (an unknown one says so)
    path = os.fspath(model)
    if weights is not None:
        raise ValueError(f"{path} is a checkpoint: it brings its own weights")
    from .hf import load_checkpoint  # torch-heavy families: only when a checkpoint is named
    return load_checkpoint(path)
