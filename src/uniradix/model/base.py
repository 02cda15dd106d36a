"""What an engine needs of a model, whatever its architecture: its layer list (which
states each layer keeps: the cache's components and pools follow from it), a paged
forward over the cache's pools, the no-cache oracle, and a tokenizer.

`ReferenceModel` is the embedded hybrid model; real checkpoints (model.hf) load as
other `PagedModel`s."""
from __future__ import annotations

import os

import torch

from ..specs import ModelStates
from .config import HybridConfig, preset
from .paged import PagedInput, paged_forward
from .reference import reference_forward
from .tokenizer import ByteTokenizer
from .weights import init_weights, load_weights


class PagedModel:
    """The interface. `config`: the architecture's own config; `weights`: its tensors
    (nested dicts and lists); `files`: the checkpoint files the weights came from (the
    L3 namespace fingerprints them; none: the tensors are hashed); `tokenizer`: encode /
    decode (and apply_chat_template where the checkpoint has one); `eos_token_ids`: the
    tokens that end a generation."""

    name = "model"
    config: object = None
    weights: dict = None
    files: tuple = ()
    tokenizer = None
    eos_token_ids: tuple = ()

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def context_length(self) -> int | None:
        """The most positions a sequence may span (prompt plus generated tokens), as the
        model declares it; None where nothing bounds it (the embedded model computes
        RoPE for any position). The engine refuses longer requests."""
        return None

    def states(self) -> ModelStates:
        """Each layer's states, grouped into the cache's components (FULL first)."""
        raise NotImplementedError

    def forward(self, pools: dict, inputs: list[PagedInput], wait_layer=None) -> list[torch.Tensor]:
        """Logits [n_logits, vocab] per request (its last `logit_rows` new tokens, every
        one by default: the LM head runs on no other row), reading and writing the pools
        (by component name) as PagedInput says; recurrent states are committed only after
        the last layer (a forward that fails part way leaves every state as it was)."""
        raise NotImplementedError

    def reference(self, tokens) -> torch.Tensor:
        """Logits [T, vocab] for every position of `tokens`, with no cache at all."""
        raise NotImplementedError

    def computation(self) -> dict:
        """What, besides its tensors, decides the KV and states this model computes (the
        L3 witness binds it: one fleet name over two configs must not share pages); the
        same model loaded from another layout (GGUF, safetensors) gives the same."""
        cfg = self.config
        fields = cfg if isinstance(cfg, dict) else {k: getattr(cfg, k) for k in getattr(cfg, "__dataclass_fields__", ())}
        return {"model": type(self).__name__, "config": fields}

    def to(self, device) -> "PagedModel":
        self.weights = _to(self.weights, torch.device(device))
        return self


class ReferenceModel(PagedModel):
    """The embedded hybrid model (model.config.HybridConfig) with seeded weights, a
    weights dict, or a safetensors file of weights for it."""

    name = "reference"

    def __init__(self, config: HybridConfig | str = "tiny-hybrid", weights=None) -> None:
        self.config = preset(config) if isinstance(config, str) else config
        if weights is None:
            self.weights = init_weights(self.config)
        elif isinstance(weights, dict):
            self.weights = weights
        else:
            path = os.fspath(weights)
            self.weights = load_weights(self.config, path)
            self.files = (path,)
        self.tokenizer = ByteTokenizer()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def states(self) -> ModelStates:
        return self.config.states()

    def forward(self, pools, inputs, wait_layer=None):
        return paged_forward(self.config, self.weights, pools, inputs, wait_layer=wait_layer)

    def reference(self, tokens):
        return reference_forward(self.config, self.weights, tokens)


def _to(weights, device: torch.device):
    if isinstance(weights, dict):
        return {k: _to(v, device) for k, v in weights.items()}
    if isinstance(weights, list):
        return [_to(x, device) for x in weights]
    if isinstance(weights, torch.Tensor) or hasattr(weights, "tensors"):  # a tensor, a quantized weight
        return weights.to(device)
    return weights
