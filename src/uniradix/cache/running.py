"""While a request runs: its pages grow as it decodes, its windowed pages are taken
chunk by chunk and go back once it no longer needs them, checkpoint slots are added, and
data another tier filled in moves its resume point."""
from __future__ import annotations

from array import array

from ..hicache.l2 import Staged
from ..tree import encode
from ..tree.component import page_floor
from ..tree.keys import TOKEN_BYTES
from .handles import CacheFull
from .request import RequestState

_NEG = array("i", (-1,))


class Running:
    """UnifiedRadixCache's running-request operations (a mixin: the state lives on the cache)."""

    def alloc_request(self, req: RequestState, upto: int | None = None, windows: int | None = None) -> None:
        """Allocate the request's own pages so they cover its first `upto` tokens (all by
        default); windowed components only its first `windows` (default `upto`; 0: none
        more), and only from the window its next token reads (see alloc_window). All or
        nothing: on CacheFull the request is unchanged."""
        n = req.allocated if upto is None else upto
        self._alloc_own(req, n, n if windows is None else windows, req.computed)

    def alloc_window(self, req: RequestState, end: int, start: int | None = None) -> None:
        """Windowed components' own pages for computing tokens [start, end) (start: default
        `req.computed`): every page they read, the window before `start` included. A
        request takes these chunk by chunk as it computes, never for a whole prompt at
        once; a page before that window it never had stays -1 (nothing reads it). All or
        nothing: on CacheFull the request is unchanged."""
        self._alloc_own(req, 0, end, req.computed if start is None else start)

    def take_window(self, req: RequestState, b: int) -> bool:
        """The windowed pages a resume at `b` reads (the window before it), taken now for
        data another tier is about to fill in; False, nothing taken, when the pools
        cannot give them."""
        try:
            self.alloc_window(req, b, start=b)
        except CacheFull:
            return False
        return True

    def _alloc_own(self, req: RequestState, upto: int, windows: int, start: int, evict: bool = True) -> None:
        P = self.page_size
        pages, need, pad = req.pages, None, {}
        for c in self.page_comps:
            have = len(pages[c.name])
            want = -(-(upto if c.window is None else windows) // P)
            if want <= have:
                continue
            if c.window is not None:  # never-allocated pages below the window read from `start`
                pad[c] = max(0, min(c.window_start(start) // P, want) - have)
            k = want - have - pad.get(c, 0)
            if k > 0:
                if need is None:
                    need = [0] * len(self.pools)
                need[c.index] = k
        got = self.ledger.alloc(need, evict) if need is not None else None
        for c in self.page_comps:
            if pad.get(c):
                pages[c.name] += _NEG * pad[c]
            h = got[c.index] if got is not None else None
            if h is not None:
                pages[c.name] += h

    def append_tokens(self, req: RequestState, tokens) -> None:
        """Decode: extend the request by `tokens` and allocate their pages; on CacheFull
        the request is unchanged."""
        more = tokens if isinstance(tokens, bytes) else encode(tokens)
        self.alloc_request(req, (len(req.key) + len(more)) >> 2)  # CacheFull leaves req as it was
        req.key += more

    # ------------------------------------------------------------------ speculation
    def draft(self, req: RequestState, tokens) -> dict[int, int]:
        """Room for a verify chunk: pages for draft `tokens` past the request's own, and
        (with a recurrent component) a scratch slot for the state at every position in
        (computed, end] that no checkpoint captures already: where the verify may stop.
        From free handles only (a draft never evicts what is cached: speculation must not
        change what is reused). All or nothing: CacheFull leaves the request unchanged.
        Returns the scratch captures {position: slot}."""
        more = encode(tokens)
        end = (len(req.key) + len(more)) >> 2
        self._alloc_own(req, end, end, req.computed, evict=False)  # CacheFull: nothing taken
        req.key += more
        if self.ckpt is None:
            return {}
        positions = [p for p in range(req.computed + 1, end + 1) if p not in req.checkpoints]
        need = [0] * len(self.pools)
        need[self.ckpt.index] = len(positions)
        try:
            got = self.ledger.alloc(need, evict=False)[self.ckpt.index] if positions else ()
        except CacheFull:
            self.truncate(req, end - len(tokens))
            raise
        req.scratch = dict(zip(positions, got))
        return dict(req.scratch)

    def truncate(self, req: RequestState, n: int) -> None:
        """The request keeps pages for its first `n` tokens only (at least its prefix):
        the pages past them go back (KV written there, a rejected draft's, is never read)."""
        P = self.page_size
        if not req.prefix_len <= n <= req.allocated:
            raise ValueError(f"cannot truncate to {n} tokens: prefix {req.prefix_len}, {req.allocated} allocated")
        keep = -(-n // P)
        for c in self.page_comps:
            pages = req.pages[c.name]
            if len(pages) > keep:
                self.ledger.free_device(c.index, array("i", (h for h in pages[keep:] if h >= 0)))
                del pages[keep:]
        req.key = req.key[:n * TOKEN_BYTES]

    def rollback(self, req: RequestState, n: int, checkpoint_at: int | None = None, drop: int | None = None) -> None:
        """A verify chunk's end, at the accepted length `n`: the pages past the first `n`
        tokens go back (truncate), and the recurrent state becomes the one captured at `n`
        (at the chunk's own end it is in the request's slot already). `checkpoint_at`: a
        position whose captured state the request keeps as a checkpoint (the decode
        checkpoint that moves page by page), replacing checkpoint `drop`. Every other
        scratch slot goes back."""
        end = req.allocated
        self.truncate(req, n)
        if self.ckpt is None:
            return
        ci = self.ckpt.index
        scratch, req.scratch = req.scratch, {}
        if n != end and self.copy_checkpoints:
            src = scratch.get(n, req.checkpoints.get(n))
            self.pools[ci].copy_slot(src, req.state_slot)
        free = []
        if checkpoint_at is not None:
            if drop is not None:
                free.append(req.checkpoints.pop(drop))
            req.checkpoints[checkpoint_at] = scratch.pop(checkpoint_at)
        free += scratch.values()
        self.ledger.free_device(ci, free)

    def add_checkpoint(self, req: RequestState, pos: int) -> int:
        """A request-owned slot to capture the recurrent state at `pos` into; it goes to
        the tree with the request (the junction checkpoint, say)."""
        if self.ckpt is None:
            raise ValueError("this cache has no checkpoint component")
        if pos % self.page_size:
            raise ValueError(f"checkpoint position {pos} is not page-aligned ({self.page_size})")
        if pos in req.checkpoints:
            return req.checkpoints[pos]
        slot = self.ledger.alloc(self._one_slot)[self.ckpt.index][0]
        req.checkpoints[pos] = slot
        return slot

    def shareable(self, req: RequestState, upto: int) -> int:
        """The deepest page-aligned position past the request's prefix, at most `upto` and
        computed, where it still holds all a later request resuming there needs (every
        windowed component's window before it, a captured checkpoint at it): what
        `cache_unfinished(req, upto=...)` can hand to the tree for others to match now.
        0 when there is none."""
        P = self.page_size
        top = page_floor(min(upto, req.computed, req.allocated), P)
        if self.ckpt is not None:
            points = req.checkpoints
        else:
            points = (top, req.junction, *req.resume_points)
        for p in sorted({page_floor(x, P) for x in points}, reverse=True):
            if req.prefix_len < p <= top and all(
                    len(req.pages[c.name]) >= p // P and
                    min(req.pages[c.name][c.window_start(p) // P: p // P], default=0) >= 0 for c in self.windowed):
                return p
        return 0

    def release_out_of_window(self, req: RequestState, upto: int | None = None) -> int:
        """Free the request's own windowed pages that fell out of the window, except the
        windows at its junction and resume points; returns how many were freed. The
        window kept is the one ending at the page-aligned end (what the tree will cache),
        which also covers the window that decoding still reads. `upto` (default: all it
        allocated) is how far the request has computed, for a chunked prefill whose later
        chunks still read the window before them."""
        P = self.page_size
        end = page_floor(req.allocated if upto is None else min(upto, req.allocated), P)
        freed, mark = 0, None
        for c in self.windowed:
            stop = c.window_start(end) // P
            kept = [(c.window_start(j) // P, j // P) for j in (req.junction, *req.resume_points)]
            freed += self._free_own(req, c, max(req.window_freed, req.prefix_len // P), stop, kept)
            mark = stop if mark is None else min(mark, stop)
        if mark is not None and mark > req.window_freed:
            req.window_freed = mark
        return freed

    def cache_behind_window(self, req: RequestState, upto: int | None = None) -> bool:
        """With spare windows: the request's computed tokens go into the tree
        (cache_unfinished) after each prefill chunk, so every window page of its prompt
        stays cached (as a spare where no resume point needs it) instead of going back
        once it falls out of the window, and its lock moves to its computed end: it
        holds the window its next chunk reads, as when they are freed. Called as a
        prompt is computed, before release_out_of_window; False when nothing went in
        (no spare windows, no new whole page)."""
        if not self.spare_windows:
            return False
        P = self.page_size
        top = page_floor(req.computed if upto is None else min(upto, req.computed), P)
        top = min(top, page_floor(req.allocated, P))
        if top <= req.prefix_len or self.shareable(req, top) != top:
            return False
        self.cache_unfinished(req, upto=top)
        return True

    def resumed_from(self, req: RequestState, upto: int) -> int:
        """The request's own pages and state were filled from another tier up to `upto`
        (page-aligned, past its prefix): it now resumes there. Its own windowed pages
        below the window before `upto` hold nothing and are freed (no junction window
        is kept for them); returns how many were freed."""
        P = self.page_size
        if upto % P or upto < req.prefix_len or upto > req.allocated:
            raise ValueError(f"cannot resume at {upto}: prefix {req.prefix_len}, {req.allocated} tokens, page {P}")
        freed = sum(self._free_own(req, c, req.prefix_len // P, c.window_start(upto) // P, ())
                    for c in self.windowed)
        req.reused = req.computed = upto
        return freed

    def _free_own(self, req: RequestState, c, start: int, stop: int, kept) -> int:
        """Free the request's present pages of component c in pages [start, stop), except
        those inside a kept (lo, hi) page range; they become -1."""
        pages = req.pages[c.name]
        out = array("i")
        for p in range(start, min(stop, len(pages))):
            h = pages[p]
            if h >= 0 and not any(lo <= p < hi for lo, hi in kept):
                out.append(h)
                pages[p] = -1
        self.ledger.free_device(c.index, out)
        return len(out)

    def stage_fetched(self, req: RequestState, fetched) -> bool:
        """Land data read from L3 in the host tier and load it into the request's pages
        layer by layer (see HostTier.stage); False without a host tier or room."""
        if self.host is None:
            return False
        if req.staged is None:
            req.staged = Staged()
        return self.host.stage(req.staged, fetched, fetched.b)
