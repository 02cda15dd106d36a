"""Attention KV: a handle per page, over the whole prefix (FULL) or a sliding window."""
from __future__ import annotations

from dataclasses import dataclass

from ..memory import KVPool, PoolPlan
from ..tree.component import PageComponent, first_visible
from .spec import StateSpec


@dataclass(frozen=True)
class KVShape:
    """One attention layer's KV: heads, head size and dtype (a torch dtype name)."""

    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"


class _KV(StateSpec):
    window: int | None = None

    def first_key(self, pos):
        """The first key a query at `pos` reads (0 for the whole prefix): the model's mask
        and the tree's rule both come from it. `pos` may be a tensor."""
        return 0 if self.window is None else first_visible(pos, self.window)

    def tree_component(self):
        comp = PageComponent(window=self.window)
        comp.name = self.name
        comp.structural = self.structural
        comp.plans = not self.structural
        return comp

    def pool_plan(self, layers, *, page_size, size, device, what, flags):
        import torch
        shapes = {ls.shape for ls in layers}
        if len(shapes) > 1:
            raise ValueError(f"{self.name}: layers {[ls.layer for ls in layers]} keep KV of different "
                             f"shapes {sorted(map(str, shapes))}; one pool needs one shape")
        shape = shapes.pop() if shapes else KVShape(1, 1)
        kv = dict(page_size=page_size, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                  dtype=getattr(torch, shape.dtype))
        ids = tuple(ls.layer for ls in layers) or (0,)
        return PoolPlan(self.name, KVPool, ids, size, kv, device, accounting_only=not layers, what=what,
                        unit="pages", flags=flags)


@dataclass(frozen=True)
class FullKV(_KV):
    """KV of every page of the prefix; it shapes the tree. Sized by --max-total-tokens."""

    name: str = "full"
    structural = True

    def pool_size(self, cache, max_running, page_size):
        return (cache.max_total_tokens // page_size, ("--max-total-tokens",), f"the {self.name.upper()} KV pool",
                "pages")


@dataclass(frozen=True)
class SlidingWindowKV(_KV):
    """KV of the pages touching the last `window` - 1 tokens before a boundary (a query
    reads `window` keys, itself included). Sized as --swa-full-tokens-ratio of FULL."""

    window: int = 4096
    name: str = "swa"

    def __post_init__(self) -> None:
        if type(self.window) is not int or self.window < 1:
            raise ValueError(f"{self.name}: window must be an int >= 1, got {self.window!r}")

    def pool_size(self, cache, max_running, page_size):
        from ..memory.budget import handle_count
        what, flags = f"the {self.name.upper()} KV pool", ("--swa-full-tokens-ratio", "--max-total-tokens")
        full = cache.max_total_tokens // page_size
        return handle_count(max(1, full * cache.swa_full_tokens_ratio), what, "pages", flags), flags, what, "pages"
