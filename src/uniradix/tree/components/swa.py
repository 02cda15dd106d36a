"""Sliding-window attention: a query reads its last W keys, itself included, so reuse at a
boundary needs KV only for the pages touching the W - 1 tokens before it."""
from ..component import PageComponent


class SWAComponent(PageComponent):
    """`keep_all` keeps every SWA page an insert brings instead of only the windows at
    the end of the inserted span and at the positions the insert names as junctions
    (where the request branched off, where its prompt ended); `keep_spare` keeps them
    too, as spares that eviction takes first (PageComponent)."""

    name = "swa"

    def __init__(self, window: int, keep_all: bool = False, keep_spare: bool = False) -> None:
        super().__init__(window=window, keep_all=keep_all, keep_spare=keep_spare)
