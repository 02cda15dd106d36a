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

    def tree_component(self, keep_spare: bool = False):
        comp = PageComponent(window=self.window, keep_spare=keep_spare)
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
    """KV of every page of the prefix; it shapes the tree. --max-total-tokens pages is
    the KV budget's unit (every KV layer keeping that many tokens); engine.build gives
    FULL what the other KV pools leave of the budget."""

    name: str = "full"
    structural = True

    def pool_size(self, cache, max_running, page_size):
        return (cache.max_total_tokens // page_size, ("--max-total-tokens",), f"the {self.name.upper()} KV pool",
                "pages")


@dataclass(frozen=True)
class SlidingWindowKV(_KV):
    """KV of the pages touching the last `window` - 1 tokens before a boundary (a query
    reads `window` keys, itself included). Sized as --swa-full-tokens-ratio of FULL when
    given (SGLang's meaning), else from the workload (`demand`)."""

    window: int = 4096
    name: str = "swa"

    def __post_init__(self) -> None:
        if type(self.window) is not int or self.window < 1:
            raise ValueError(f"{self.name}: window must be an int >= 1, got {self.window!r}")

    def window_pages(self, page_size: int) -> int:
        """The most pages one position's window touches: the W - 1 tokens before it
        and its own page."""
        return -(-(self.window - 1) // page_size) + 1

    #: how long, in windows, the conversations a derived pool keeps windows for are
    #: taken to be: one window per CACHED_WINDOWS windows of the FULL pool
    CACHED_WINDOWS = 8

    def demand(self, cache, max_running: int, page_size: int) -> dict[str, int]:
        """The pages the workload needs, by what for: the window of each running request,
        the step's prefill chunk (--chunked-prefill-size is the whole batch's; a prompt
        never needs window pages for all of itself: each chunk takes the pages it reads
        when it is scheduled, and those that fall out of the window go back after it),
        and what the tree caches: a window at each sequence end it keeps, counted as one
        per CACHED_WINDOWS windows of the FULL pool (conversations of 8 windows: Gemma
        3's 4k tokens), where a 1:1 pool would keep a window for every window's worth
        of tokens cached."""
        P = page_size
        full = getattr(cache, "full_pages", cache.max_total_tokens // P)
        return {"running": max_running * self.window_pages(P),
                "chunk": -(-getattr(cache, "chunk", 0) // P) + 1,
                "cached": -(-full // self.CACHED_WINDOWS)}

    def pool_size(self, cache, max_running, page_size):
        """--swa-full-tokens-ratio x FULL's pages when the ratio is given; else the
        workload's demand, at most the 1:1 pool (--max-total-tokens pages)."""
        from ..memory.budget import handle_count
        what = f"the {self.name.upper()} KV pool"
        ratio = cache.swa_full_tokens_ratio
        if ratio is not None:
            flags = ("--swa-full-tokens-ratio", "--max-total-tokens")
            full = getattr(cache, "full_pages", cache.max_total_tokens // page_size)
            return handle_count(max(1, full * ratio), what, "pages", flags), flags, what, "pages"
        one_to_one = cache.max_total_tokens // page_size
        n = max(1, min(one_to_one, sum(self.demand(cache, max_running, page_size).values())))
        return n, ("--max-total-tokens", "--swa-full-tokens-ratio"), what, "pages"
