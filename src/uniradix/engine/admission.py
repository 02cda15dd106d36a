"""Admission: a waiting request is matched against the cache and given its pages (or
waits, or fails when it never could fit), reads what L3 holds deeper when that is worth
it, and starts at its boundary with the checkpoints it should leave behind."""
from __future__ import annotations

from ..cache import CacheFull, RequestState
from ..tree.component import page_floor
from .request import Request


class Admission:
    """Engine's admission (a mixin: the state lives on the engine)."""

    def _admit(self, done: list[Request]) -> None:
        while self.waiting and len(self.running) + len(self.prefetching) < self.max_running:
            st = self.waiting[0]
            req = st.owner
            try:
                self._match(st)
            except CacheFull as e:
                if self.running or self.prefetching:
                    return  # it waits for admitted requests to free their pages
                self.waiting.popleft()
                self._fail(req, f"request {req.rid} can never fit: {e}")
                done.append(req)
                continue
            except Exception as e:
                self._abort(st, e, done)
                continue
            self.waiting.popleft()
            try:
                self.cache.zero_state(st)  # nothing to resume: the state starts from zeros
                if self.storage is not None and self.use_cache and self.storage.worth_reading(st):
                    self.storage.prefetch(st)
                    if req.status == "waiting":
                        req.status = "prefetching"
                    continue
                self._start(st, st.prefix_len)
            except Exception as e:
                self._abort(st, e, done)

    def _match(self, st: RequestState) -> None:
        """Match all but the last token, so at least one is computed and gives the
        logits to sample from, and allocate pages for all of them; all or nothing."""
        st.prompt_len = len(st.tokens)
        self.cache.match_prefix(st.tokens[:-1], st.salt, st.priority, alloc=True, state=st)
        try:
            self.cache.alloc_request(st, len(st.tokens))
        except CacheFull:
            self.cache.release(st)
            raise

    def _start_prefetched(self, done: list[Request]) -> None:
        for st, b in self.storage.poll():
            try:
                if isinstance(b, BaseException):
                    raise b
                self._start(st, b)
            except Exception as e:
                self._abort(st, e, done)

    def _start(self, st: RequestState, b: int) -> None:
        """The request resumes at b (its device boundary, or deeper from L3): running."""
        req = st.owner
        st.computed = b
        if req.status in ("waiting", "prefetching"):  # first admission, not a preempted one
            m = req.metrics
            m.cached_tokens, m.host_tokens, m.storage_tokens = b, st.host_tokens, b - st.prefix_len
            self.counters["host_tokens"] += st.host_tokens
            self.counters["cached_tokens"] += b
            self.counters["prompt_tokens"] += len(st.tokens)
        req.status = "running"
        P = self.page_size
        # the same prompt sent again matches all but its last token: it resumes here
        end = page_floor(st.prompt_len - 1, P)
        if end > b and (self.keeps_windows or self.captures):
            st.resume_points.append(end)
        if self.captures:
            for pos in {page_floor(st.junction, P), end}:
                if pos > b:
                    self._checkpoint(st, pos)
        self.running.append(st)

    def _checkpoint(self, st: RequestState, pos: int) -> int | None:
        """A slot to capture the state at pos; skipped (None) when the pool is short,
        since a checkpoint only saves later work."""
        try:
            return self.cache.add_checkpoint(st, pos)
        except CacheFull:
            self.counters["checkpoints_skipped"] += 1
            return None
