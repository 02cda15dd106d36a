"""A Hugging Face checkpoint directory as the engine reads it, with no `transformers`:
config.json (the text model's part of a multimodal one), its weights (model.safetensors
or shards with their index), generation_config.json (the eos ids) and the tokenizer
(tokenizer.json with tokenizer_config.json and the chat template). The families' ways
of marking layer kinds and of giving RoPE settings, current and legacy, are read into
one form here."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

#: one name per layer kind, whatever a family's config calls it
FULL, SLIDING, LINEAR, MAMBA, MLP, MOE, HYBRID = ("full_attention", "sliding_attention", "linear_attention",
                                                   "mamba", "mlp", "moe", "hybrid")


@dataclass
class Checkpoint:
    """What a family builds its model from."""

    path: str
    config: dict
    tensors: dict = field(repr=False)
    files: tuple = ()
    generation: dict = field(default_factory=dict)
    tokenizer: object = None

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "?")

    def get(self, key: str, default=None):
        return self.config.get(key, default)

    def eos_token_ids(self) -> tuple:
        """From generation_config.json, else config.json."""
        for src in (self.generation, self.config):
            e = src.get("eos_token_id")
            if e is not None:
                return tuple(e) if isinstance(e, (list, tuple)) else (int(e),)
        return ()


def read_checkpoint(path: str, dtype: torch.dtype | None = None) -> Checkpoint:
    """Read a checkpoint directory; `dtype`: cast floating-point weights to it."""
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a checkpoint directory (config.json and safetensors)")
    config = _json(os.path.join(path, "config.json"), required=True)
    if "text_config" in config:  # a multimodal wrapper: the text model is what we serve
        config = {**config["text_config"], "architectures": config.get("architectures", []),
                  "_wrapped_model_type": config.get("model_type")}
    tensors, files = _load_safetensors(path, dtype)
    from .tokenizer import HFTokenizer
    tok = HFTokenizer.from_dir(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    return Checkpoint(path, config, tensors, files, _json(os.path.join(path, "generation_config.json")), tok)


def _json(path: str, required: bool = False) -> dict:
    if not os.path.exists(path):
        if required:
            raise ValueError(f"{path} is missing")
        return {}
    with open(path) as f:
        return json.load(f)


def _load_safetensors(path: str, dtype) -> tuple[dict, tuple]:
    from safetensors.torch import load_file
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(_json(index)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors (or shards with model.safetensors.index.json)")
    tensors: dict = {}
    full = tuple(os.path.join(path, f) for f in files)
    for f in full:
        for name, t in load_file(f).items():
            tensors[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return tensors, full


# ---------------------------------------------------------------------------- layer kinds
_ALIASES = {"attention": FULL, "full_attention": FULL, "sliding_attention": SLIDING,
            "linear_attention": LINEAR, "mamba": MAMBA, "mamba2": MAMBA, "mlp": MLP, "moe": MOE,
            "hybrid": HYBRID, "conv": LINEAR}
_PATTERN = {"M": MAMBA, "*": FULL, "-": MLP, "E": MOE}


def layer_types(config: dict) -> list[str]:
    """Each layer's kind, from `layer_types`, `layers_block_type`, `attn_layer_indices`,
    `hybrid_override_pattern` or `attn_layer_period` / `attn_layer_offset` (the ways the
    families mark them), in the names of this module."""
    n = config.get("num_hidden_layers")
    for key in ("layer_types", "layers_block_type"):
        kinds = config.get(key)
        if kinds:
            return [_kind(k) for k in kinds]
    if config.get("hybrid_override_pattern"):
        return [_PATTERN[c] for c in config["hybrid_override_pattern"]]
    if config.get("attn_layer_indices") is not None:
        idx = set(config["attn_layer_indices"])
        return [FULL if i in idx else MAMBA for i in range(n)]
    if config.get("attn_layer_period"):
        p, o = config["attn_layer_period"], config.get("attn_layer_offset", 0)
        return [FULL if i % p == o else MAMBA for i in range(n)]
    if n is None:
        raise ValueError("config.json gives neither num_hidden_layers nor the layer kinds")
    return [FULL] * n


def _kind(k: str) -> str:
    try:
        return _ALIASES[k]
    except KeyError:
        raise ValueError(f"unknown layer kind {k!r} (known: {sorted(_ALIASES)})") from None


# ---------------------------------------------------------------------------- RoPE
def rope_parameters(config: dict, layer_type: str | None = None) -> dict | None:
    """The RoPE setup of a layer kind, from `rope_parameters` (flat, or nested by layer
    kind) or the legacy `rope_theta` / `rope_scaling` / `rope_local_base_freq` /
    `partial_rotary_factor` keys: {rope_type, rope_theta, partial_rotary_factor, ...}.
    None where the model has no RoPE."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params = params[layer_type]
        if params is None:
            return None
    elif isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        params = next(v for v in params.values() if isinstance(v, dict))
    params = dict(params or {})
    legacy = config.get("rope_scaling") or {}
    if layer_type == SLIDING and config.get("rope_local_base_freq") is not None and "rope_theta" not in params:
        params["rope_theta"] = config["rope_local_base_freq"]
        legacy = {}  # the local base is plain RoPE
    for k, v in legacy.items():
        params.setdefault("rope_type" if k == "type" else k, v)
    params.setdefault("rope_theta", config.get("rope_theta"))
    if config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    params.setdefault("rope_type", params.pop("type", "default"))
    if params["rope_theta"] is None:
        return None
    if params["rope_type"] in ("yarn", "llama3", "longrope"):
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return params
