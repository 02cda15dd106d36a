"""One request's state, shared by the scheduler and the cache: one object from
admission to the end, with one name per idea."""
from __future__ import annotations


class RequestState:
    """A request while an engine holds it (or, for a cache used alone, while it runs).

    Tokens and progress (positions in tokens):
    - `tokens`: every token known (the prompt, then what was generated); the scheduler's.
    - `key`: the tokens the request has pages for, as the tree's bytes; `allocated` of them.
    - `prompt_len`: tokens known at admission; below it is prefill.
    - `computed`: tokens whose KV is in the pages and whose state is in `state_slot`.
    - `prefix_len`: tokens [0, prefix_len) belong to the tree (pinned by `receipt`); the
      pages past it are the request's own.
    - `reused`: tokens it resumed from when it started (from any tier), `host_tokens` of
      them loaded from the host tier and `storage_tokens` from L3, `cross_instance_tokens`
      of those from L3 objects another instance wrote.
    - `junction`: where its tokens stopped matching the cached path; `resume_points`:
      further positions (the prompt's end) where later requests should be able to
      resume. The window before each is kept, and a checkpoint captured there.

    Holdings: `pages[name]` one handle per page per page component (-1 where a windowed
    component's page was freed or never taken; a windowed component's list may end
    short of `allocated`: an engine takes its pages chunk by chunk), `state_slot` its
    own recurrent state, `checkpoints` {position: slot} captured (or to capture) at
    page-aligned positions, `rolling` the position of the decode checkpoint that moves
    page by page, `staged` host copies of pages it read from L3 (its own until it is
    cached). `owner`: the client's request (opaque to the cache); `rng`: its sampling
    generator; `order`: when the scheduler queued it (kept across preemption). `share_at`: positions past its prefix that
    waiting requests share with it: each goes into the tree as soon as it is computed
    (cache_unfinished), so they resume there instead of computing it again.

    Speculation: `scratch` {position: slot} the recurrent states a verify chunk captures
    at every position it may stop at (its own only for that step: `rollback` keeps the
    accepted one and frees the rest); `spec` the scheduler's drafting state for the
    request (opaque to the cache; kept across preemption, as `tokens` are)."""

    __slots__ = ("tokens", "owner", "salt", "priority", "prompt_len", "rng", "key", "computed", "prefix_len",
                 "reused", "host_tokens", "storage_tokens", "cross_instance_tokens", "junction", "resume_points", "pages", "receipt", "node",
                 "state_slot", "checkpoints", "rolling", "window_freed", "staged", "held", "order", "share_at", "scratch",
                 "spec")

    def __init__(self, tokens=None, *, salt=None, priority=None, owner=None) -> None:
        self.tokens = tokens
        self.owner = owner
        self.salt = salt
        self.priority = priority
        self.prompt_len = len(tokens) if tokens is not None else 0
        self.rng = None
        self.order = 0
        self.spec = None
        self.clear()

    def clear(self) -> None:
        """Hold nothing of the cache (before admission, or back in the queue)."""
        self.key = b""
        self.computed = self.prefix_len = self.reused = self.junction = 0
        self.host_tokens = self.storage_tokens = self.cross_instance_tokens = 0
        self.resume_points: list[int] = []
        self.pages: dict = {}
        self.receipt = None
        self.node = None
        self.state_slot: int | None = None
        self.checkpoints: dict[int, int] = {}
        self.scratch: dict[int, int] = {}
        self.rolling: int | None = None
        self.window_freed = 0
        self.staged = None
        self.share_at: list[int] = []
        self.held = False  # the cache holds pages, locks or slots for it

    @property
    def allocated(self) -> int:
        """Tokens with pages: len(key)."""
        return len(self.key) >> 2

    def captures(self, start: int, end: int) -> dict[int, int]:
        """Checkpoints to capture while computing positions (start, end]."""
        return {p: s for p, s in self.checkpoints.items() if start < p <= end}

    def __repr__(self) -> str:
        return (f"RequestState(allocated={self.allocated}, computed={self.computed}, reused={self.reused}, "
                f"prefix_len={self.prefix_len}, junction={self.junction}, held={self.held})")
