"""Paged K/V storage for a group of attention layers (FULL or SWA)."""

from __future__ import annotations

import torch

from ._checks import positive_int, torch_dtype
from .pool import HandlePool

__all__ = ["KVPool"]


class KVPool(HandlePool):
    """K and V pages for ``layer_ids``; a page handle indexes every layer.

    One ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]`` buffer
    each for K and V, so ``k(layer)`` is a contiguous view and a whole page
    across layers can be moved with one indexing op.  FULL and SWA layers use
    separate instances (SWA's is normally much smaller).
    """

    kind = "KVPool"

    def __init__(self, layer_ids, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float16, device="cpu", *,
                 accounting_only: bool = False, name: str = "kv", pin_memory: bool = False):
        super().__init__(num_pages, name=name, layer_ids=layer_ids, device=device,
                         accounting_only=accounting_only, pin_memory=pin_memory)
        self._page_size = positive_int(page_size, f"KVPool {name!r} page_size")
        self._num_kv_heads = positive_int(num_kv_heads, f"KVPool {name!r} num_kv_heads")
        self._head_dim = positive_int(head_dim, f"KVPool {name!r} head_dim")
        self._dtype = torch_dtype(dtype, f"KVPool {name!r} dtype")
        self._shape = dict(page_size=self._page_size, num_kv_heads=self._num_kv_heads,
                           head_dim=self._head_dim, dtype=self._dtype)
        self._k = self._v = None
        self._slots: dict = {}
        if not self._accounting_only:
            self._k, self._v = self._zeros()

    @staticmethod
    def handle_rows(*, page_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype = torch.float16):
        """One layer's K row and V row for one page."""
        page = (page_size, num_kv_heads, head_dim)
        return [(page, dtype), (page, dtype)]

    @property
    def num_pages(self) -> int:
        return self.size

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """Shape of one page of one layer's K (or V)."""
        return (self._page_size, self._num_kv_heads, self._head_dim)

    def _handle_tensors(self) -> list[torch.Tensor]:
        return [self._k, self._v]

    def k(self, layer_id: int) -> torch.Tensor:
        """K pages of one layer: ``[num_pages, page_size, num_kv_heads, head_dim]``."""
        i = self._layer(layer_id)
        self._require_tensors()
        return self._k[i]

    def v(self, layer_id: int) -> torch.Tensor:
        """V pages of one layer: ``[num_pages, page_size, num_kv_heads, head_dim]``."""
        i = self._layer(layer_id)
        self._require_tensors()
        return self._v[i]

    def slots(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer by flat slot (page * page_size + offset): two
        ``[num_pages * page_size, num_kv_heads, head_dim]`` views, made once a layer
        (attention asks for them in every layer of every step)."""
        hit = self._slots.get(layer_id)
        if hit is None:
            hit = self._slots[layer_id] = (self.k(layer_id).flatten(0, 1), self.v(layer_id).flatten(0, 1))
        return hit
