"""Admission: a waiting request is matched against the cache and given its pages (or
waits, or fails when it never could fit), reads what L3 holds deeper when that is worth
it, and starts at its boundary with the checkpoints it should leave behind.

Requests that arrive together and share a prefix the cache lacks compute it once: a
waiting request whose uncached prefix an earlier running request (the leader) is still
computing is held, in its place in the queue and with its batch slot kept, until the
leader has computed that prefix and put it in the tree (with the window and the
checkpoint a resume there needs, captured for the purpose); then it is admitted and
matches it. A hold lasts only while its leader runs: a leader that finishes, is
preempted or aborted releases it at the next step."""
from __future__ import annotations

from ..cache import CacheFull, RequestState
from ..tree.component import page_floor
from ..tree.keys import TOKEN_BYTES, common_prefix, encode, salt_key
from .request import Request

#: a waiting request is held for a leader only when that saves it at least this many
#: prefill tokens (and a page): less is not worth a step's wait
MIN_SHARED_TOKENS = 32


class Admission:
    """Engine's admission (a mixin: the state lives on the engine)."""

    def _admit(self, done: list[Request]) -> None:
        if self.use_cache:
            self._publish(done)
        held = i = 0
        while i < len(self.waiting) and len(self.running) + len(self.prefetching) + held < self.max_running:
            st = self.waiting[i]
            req = st.owner
            try:
                if self.use_cache and self._held(st, done):
                    held += 1  # it keeps its place and its slot; those behind it go on
                    i += 1
                    continue
                self._match(st)
            except CacheFull as e:
                if self.running or self.prefetching:
                    break  # it waits for admitted requests to free their pages
                del self.waiting[i]
                self._fail(req, f"request {req.rid} can never fit: {e}")
                done.append(req)
                continue
            except Exception as e:
                self._abort(st, e, done)
                continue
            del self.waiting[i]
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
        self.holding = held

    # ------------------------------------------------------------------ in-batch sharing
    def _held(self, st: RequestState, done: list[Request]) -> bool:
        """Whether `st` waits for an earlier running request to put the prefix they share
        in the tree. The deepest shared prefix is tried first: a leader that has computed
        it and still holds what a resume there needs puts it in the tree now; one still
        computing it is asked to capture a checkpoint and keep the window there, and
        `st` waits. Nothing to gain, or no leader able to give it: admitted as it is."""
        reading = self.prefetching
        if not self.running and not reading or reuse_end(st) < len(st.tokens) - 1:
            return False  # nobody to wait for, or it reuses less than the prefix (prompt logprobs)
        P = self.page_size
        page_bytes = P * TOKEN_BYTES
        key = encode(st.tokens[:-1])  # what its match covers: the last token is computed
        salt = salt_key(st.salt)
        shared = []
        for lead in (*self.running, *reading):
            if lead.order >= st.order or salt_key(lead.salt) != salt:
                continue  # later than it (FIFO), or another tenant
            # what the leader computes as prefill: its decode is one token a step
            c = common_prefix(key, 0, lead.key[:lead.prompt_len * TOKEN_BYTES], page_bytes) // TOKEN_BYTES
            c -= c % P  # a whole prefix comes back unrounded
            if c > lead.prefix_len:
                shared.append((c, lead))
        if not shared:
            return False
        own = self.cache.reusable(key, st.salt)
        for c, lead in sorted(shared, key=lambda x: (-x[0], x[1] in reading)):
            if c - own < max(MIN_SHARED_TOKENS, P):
                return False
            if lead in reading:  # its L3 read may bring the prefix: asked again once it runs
                return True
            if lead.computed >= c:  # computed: in the tree now, if it still has all of it
                p = self.cache.shareable(lead, c)
                if p - own >= max(MIN_SHARED_TOKENS, P):
                    self._cache_prefix(lead, p, done)
                    return False
                if lead.reused >= c:  # a tier gave it the prefix: it can give it this one too
                    return False
            elif self._share(lead, c):
                return True
        return False

    def _share(self, lead: RequestState, pos: int) -> bool:
        """Ask a running request to leave what a resume at `pos` needs (the window before
        it, a checkpoint at it) and to put its prefix to `pos` in the tree once computed.
        False when no checkpoint slot is free."""
        if pos in lead.share_at:
            return True
        if self.captures and self._checkpoint(lead, pos) is None:
            return False
        if (self.keeps_windows or self.captures) and pos not in lead.resume_points:
            lead.resume_points.append(pos)
        lead.share_at.append(pos)
        return True

    def _publish(self, done: list[Request]) -> None:
        """Running requests put the shared prefixes they have computed in the tree."""
        for st in list(self.running):
            if not st.share_at or min(st.share_at) > st.computed:
                continue
            pos = self.cache.shareable(st, max(p for p in st.share_at if p <= st.computed))
            st.share_at = [p for p in st.share_at if p > st.computed]
            if pos:
                self._cache_prefix(st, pos, done)

    def _cache_prefix(self, st: RequestState, pos: int, done: list[Request]) -> None:
        """A running request's first `pos` tokens go into the tree; it goes on."""
        try:
            self.cache.cache_unfinished(st, upto=pos)
            self.counters["shared_prefixes"] += 1
        except Exception as e:
            self._abort(st, e, done)

    def _match(self, st: RequestState) -> None:
        """Match all but the last token, so at least one is computed and gives the
        logits to sample from, and allocate pages for all of them; all or nothing. The
        windowed components get none past the reused prefix here: each prefill chunk
        takes the window pages it reads when it is scheduled (batching._chunk_pages), so
        a prompt never needs window pages for all of itself at once."""
        st.prompt_len = len(st.tokens)
        self.cache.match_prefix(st.tokens[:reuse_end(st)], st.salt, st.priority, alloc=True, state=st, windows=0)
        try:
            self.cache.alloc_request(st, len(st.tokens), windows=0)
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
            m.cross_instance_tokens = st.cross_instance_tokens
            # every tier's count at the first admission only, as the cached tokens: a
            # preempted request that reads L3 again is not counted twice
            self.counters["host_tokens"] += st.host_tokens
            self.counters["storage_tokens"] += m.storage_tokens
            self.counters["storage_cross_instance_tokens"] += m.cross_instance_tokens
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


def reuse_end(st: RequestState) -> int:
    """How much of its tokens a request may take from the cache: all but the last (which
    must be computed for its logits), or, while its prompt logprobs from p are still to
    come, p - 1 (the row before a token is the one that scores it)."""
    req = st.owner
    p = req.prompt_logprobs_from
    if p is None or len(req.prompt_logprobs) >= len(req.input_ids) - p:
        return len(st.tokens) - 1
    return min(len(st.tokens) - 1, max(0, p - 1))
