"""What every Hugging Face family shares: the layer list read from its config (which
states each layer keeps, so the cache's components and pools), the forward skeleton
(embed, one block per layer, final norm, head) over a Batch, and a no-cache oracle that
runs the same forward over scratch pools. A family writes `embed`, `block` and `head`
(and the states its recurrent layers keep)."""
from __future__ import annotations

import torch

from ...specs import FullKV, KVShape, LayerState, RecurrentState, SlidingWindowKV, group_layers
from ..base import PagedModel
from .checkpoint import FULL, HYBRID, LINEAR, MAMBA, SLIDING, Checkpoint, layer_types
from .ops import Batch

FULL_KV = FullKV()
RECURRENT = RecurrentState()


class HFModel(PagedModel):
    """A model loaded from a checkpoint. Subclasses set `model_types` (the config's
    model_type values they serve) and write embed / block / head; `recurrent_shape(i)`
    for families with recurrent layers."""

    model_types: tuple = ()

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype = torch.float32) -> None:
        self.ckpt = ckpt
        self.config = ckpt.config
        self.dtype = dtype
        self.weights = ckpt.tensors
        self.files = ckpt.files
        self.tokenizer = ckpt.tokenizer
        self.eos_token_ids = ckpt.eos_token_ids()
        self.kinds = layer_types(ckpt.config)
        self.name = ckpt.model_type
        c = self.config  # the attention shape, read once for the KV pools and the forward
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.heads

    # ------------------------------------------------------------------ the layer list
    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    def kv_shape(self, i: int) -> KVShape:
        return KVShape(self.kv_heads, self.head_dim, str(self.dtype).removeprefix("torch."))

    def recurrent_shape(self, i: int):
        raise NotImplementedError(f"{self.name} has no recurrent layers")

    def window(self, i: int) -> int | None:
        """The sliding window of layer i (keys a query reads, itself included)."""
        return self.config.get("sliding_window") if self.kinds[i] == SLIDING else None

    def layer_states(self) -> list[LayerState]:
        out = []
        for i, kind in enumerate(self.kinds):
            if kind in (FULL, HYBRID):
                out.append(LayerState(i, FULL_KV, self.kv_shape(i)))
            if kind == SLIDING:
                out.append(LayerState(i, SlidingWindowKV(self.window(i)), self.kv_shape(i)))
            if kind in (LINEAR, MAMBA, HYBRID):
                out.append(LayerState(i, RECURRENT, self.recurrent_shape(i)))
        return out

    def states(self):
        return group_layers(self.layer_states(), FULL_KV)

    def spec(self, i: int):
        """The KV spec layer i attends over (None: it has no attention)."""
        kind = self.kinds[i]
        if kind in (FULL, HYBRID):
            return FULL_KV
        if kind == SLIDING:
            return SlidingWindowKV(self.window(i))
        return None

    # ------------------------------------------------------------------ the forward
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def block(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Layer i over the batch's hidden states x [N, D]: attention through
        ops.paged_attention, recurrent mixers through ops.run_recurrent."""
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, pools, inputs, wait_layer=None):
        if not inputs:
            return []
        device = next(iter(self.weights.values())).device
        batch = Batch(pools, inputs, device)
        x = self.embed(batch.ids)
        for i in range(len(self.kinds)):
            if wait_layer is not None:
                wait_layer(i)
            x = self.block(i, x, batch)
        logits = self.head(x).float()
        batch.commit()  # only now does any request's recurrent state advance
        return list(logits.split(batch.lens))

    @torch.no_grad()
    def reference(self, tokens) -> torch.Tensor:
        """The same forward over scratch pools holding just these tokens."""
        from ...engine.build import build_cache
        from ..paged import PagedInput
        tokens = list(tokens)
        cache, pools = build_cache(self, page_size=1, max_total_tokens=len(tokens) + 1,
                                   max_mamba_cache_size=1, device=next(iter(self.weights.values())).device)
        pages = {name: pools[name].alloc(len(tokens)) for name in pools if hasattr(pools[name], "page_size")}
        slot = None
        if cache.ckpt is not None:
            slot = cache.pools[cache.ckpt.index].alloc(1)[0]
            cache.pools[cache.ckpt.index].zero_slots([slot])
        return self.forward(pools, [PagedInput(tokens, 0, pages, slot)])[0]

    # ------------------------------------------------------------------ weights
    def tied_head(self, embed: str = "model.embed_tokens.weight") -> torch.Tensor:
        """lm_head.weight, or the embedding where the checkpoint ties them."""
        head = self.weights.get("lm_head.weight")
        return head if head is not None else self.w(embed)

    def w(self, name: str) -> torch.Tensor:
        try:
            return self.weights[name]
        except KeyError:
            raise ValueError(f"{self.ckpt.path}: no tensor {name!r} in the checkpoint") from None

    def has(self, name: str) -> bool:
        return name in self.weights
