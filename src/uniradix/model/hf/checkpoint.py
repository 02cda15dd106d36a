"""A Hugging Face checkpoint directory as the engine reads it, with no `transformers`:
config.json, its weights (model.safetensors or shards with their index),
generation_config.json (the eos ids) and the tokenizer (tokenizer.json with
tokenizer_config.json and the chat template).

A multimodal checkpoint (a `text_config` in config.json: Gemma 3 4B+, Qwen3.5) is served
as its text model: the text config, with the wrapper's token ids, and the text model's
weights under the names the text-only checkpoint uses (`model.*`, `lm_head.weight`),
whether the file keeps them under `language_model.model.*` (older files) or
`model.language_model.*` (newer); the vision tower and the rest are not loaded. How a
family reads the config itself (defaults, layer kinds, RoPE) is config_forms' job."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from ...progress import progress

#: where a multimodal wrapper keeps its text model's weights -> the text-only name
TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                 "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."}
#: the token ids a wrapper's own config gives for its text model
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_TIE = "tie_word_embeddings"


@dataclass
class Checkpoint:
    """What a family builds its model from."""

    path: str
    config: dict
    tensors: dict = field(repr=False)
    files: tuple = ()
    generation: dict = field(default_factory=dict)
    tokenizer: object = None
    #: bits per weight of each tensor as the file stores it, where that is not its dtype's
    #: (a .gguf's quantized types): what `--quantization stored` follows
    stored_bits: dict = field(default_factory=dict)
    #: a .gguf's quantized tensors as the file stores them: name -> (GGML type name, raw
    #: blocks (a view of the file's map, rows of the tensor in order), (rows, inputs))
    stored_blocks: dict = field(default_factory=dict)

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
    wrapped = "text_config" in config
    config = text_config(config)
    tensors, files = _load_safetensors(path, dtype, text_weight_name if wrapped else None)
    from .tokenizer import HFTokenizer
    tok = HFTokenizer.from_dir(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    return Checkpoint(path, config, tensors, files, _json(os.path.join(path, "generation_config.json")), tok)


def text_config(config: dict) -> dict:
    """The text model's config: config.json itself, or a multimodal wrapper's
    `text_config` (its model_type, where it names none, and the wrapper's token ids, which
    override the text config's as in transformers' generation defaults). Whether the head
    is tied to the embedding is the wrapper's to say, as transformers reads it: the
    wrapper's `tie_word_embeddings`, else its class's default (the text class's too, for
    the wrappers served), never the text_config's."""
    if "text_config" not in config:
        return config
    if not isinstance(config["text_config"] or {}, dict):
        raise ValueError(f"config.json `text_config` must be an object, got {config['text_config']!r:.60}")
    text = dict(config["text_config"] or {})
    text.setdefault("model_type", config.get("model_type"))
    for k in _TOKEN_IDS:
        if config.get(k) is not None:
            text[k] = config[k]
    text.pop(_TIE, None)
    if config.get(_TIE) is not None:
        text[_TIE] = config[_TIE]
    text["architectures"] = config.get("architectures", [])
    text["_wrapped_model_type"] = config.get("model_type")
    return text


def text_weight_name(name: str) -> str | None:
    """A wrapper's tensor under its text-only name (TEXT_PREFIXES), None for the rest."""
    for prefix, to in TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return None


def _json(path: str, required: bool = False) -> dict:
    """A JSON object from `path` ({} where an optional file is absent); a file that is
    not one is a ValueError naming it."""
    if not os.path.exists(path):
        if required:
            raise ValueError(f"{path} is missing")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(data).__name__}")
    return data


def _load_safetensors(path: str, dtype, rename=None) -> tuple[dict, tuple]:
    """Every tensor (cast to `dtype` if floating point); `rename(name)`: the name to keep
    a tensor under, None to leave it unread. Where no model tensor would be kept (a
    wrapper whose file already uses the text-only names), every tensor is kept as named."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} has no weight_map (tensor name -> shard file)")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path}: no model.safetensors (or shards with model.safetensors.index.json)")
    full = tuple(os.path.join(path, f) for f in files)
    names: dict = {}  # file -> {stored name: name kept}
    for f in full:
        with _open(f) as sf:
            names[f] = {n: rename(n) if rename else n for n in sf.keys()}
    if rename and not any(new and new.startswith("model.") for kept in names.values() for new in kept.values()):
        names = {f: {n: n for n in kept} for f, kept in names.items()}
    tensors: dict = {}
    for f in full:
        with _open(f) as sf:
            for name, new in progress(names[f].items(), f"reading {os.path.basename(f)}", len(names[f])):
                if new is None:
                    continue
                if new in tensors:
                    raise ValueError(f"{path}: two tensors are both {new!r} (one of them {name!r})")
                t = sf.get_tensor(name)
                tensors[new] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return tensors, full


def _open(file: str):
    """A safetensors file opened for reading; one that is missing, cut short or not
    safetensors at all is a ValueError naming it."""
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
