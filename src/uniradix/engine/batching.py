"""One step's batch: prefill chunks within the token budget, each taking the window
pages it reads, and one token per decoding request, pages grown as decoding goes
(preempting the newest request on a shortfall), the batched forward (rerun request by
request when it fails, so only the culprit fails), then sampling, and the finished
requests handed to the cache."""
from __future__ import annotations

import time

import torch

from ..cache import CacheFull, RequestState
from ..model import PagedInput
from .request import Request
from .sampling import sample, token_logprobs


class Batching:
    """Engine's batches (a mixin: the state lives on the engine)."""

    def _forward(self, batch: list, done: list[Request]) -> list:
        """Logits per batch entry. When the batched forward fails, each request runs alone
        so that only the one that fails is aborted (None in its place); the forward
        commits recurrent state only once it has run every layer, so a failed attempt
        leaves no request's state advanced."""
        cache = self.cache
        wait = cache.wait_layer if cache.pending_loads else None  # host loads still copying
        try:
            logits = self.model.forward(self.pools, [inp for _, inp in batch], wait_layer=wait)
        except Exception as e:
            if len(batch) == 1:
                logits = [None]
                self._abort(batch[0][0], e, done)
            else:
                logits = [self._forward_alone(st, inp, wait, done) for st, inp in batch]
        if wait is not None:
            cache.sync_loads()
        return logits

    def _forward_alone(self, st: RequestState, inp: PagedInput, wait, done: list[Request]):
        try:
            return self.model.forward(self.pools, [inp], wait_layer=wait)[0]
        except Exception as e:
            self._abort(st, e, done)
            return None

    def _schedule(self, done: list[Request]) -> list[tuple[RequestState, PagedInput]]:
        """The step's batch. When nothing can run because every running request waits
        for window pages (others hold them), the newest of them is preempted (what it
        computed is cached) until one can; alone, it can never fit and fails."""
        while True:
            alone = len(self.running) == 1
            batch, stalled = self._pick(done)
            if batch or not stalled or self.prefetching:
                return batch
            st = max(stalled, key=lambda s: s.order)
            if len(self.running) > 1:
                self._preempt(st, done)
                continue
            if not alone:  # the others left during the pick (finished, preempted): try it alone
                continue
            self.running.remove(st)
            self.cache.release(st)
            pools = " and ".join(c.name for c in self.cache.windowed)
            self._fail(st.owner, f"request {st.owner.rid} can never fit: the {pools} pool cannot hold the "
                                 f"window its next token reads and a page")
            done.append(st.owner)

    def _pick(self, done: list[Request]) -> tuple[list, list[RequestState]]:
        """Prefill chunks within the step's token budget, each with the window pages it
        reads (`_chunk_pages`), and one token per decoding request; also the prefilling
        requests that get no window page this step (they keep their place)."""
        budget = self.chunk
        batch, stalled = [], []
        for st in list(self.running):
            if st not in self.running:
                continue  # preempted to make room for an earlier one
            n = len(st.tokens) - st.computed
            chunked = n > 1
            if chunked:  # prefill, within the step's token budget
                n = min(n, budget)
                if n == 0:
                    continue
            try:
                if st.computed < st.prompt_len:
                    n = self._chunk_pages(st, n)
                    if not n:
                        stalled.append(st)
                        continue
                elif not self._grow(st, done):
                    continue
                if chunked:
                    budget -= n
                batch.append((st, self._input(st, n)))
            except Exception as e:
                self._abort(st, e, done)
        if self.spec is not None and batch:
            batch = self._add_drafts(batch)
        return batch, stalled

    def _chunk_pages(self, st: RequestState, n: int) -> int:
        """Take the window pages a prefill chunk of `n` tokens reads (admission gave the
        request none past its prefix); on a shortfall the chunk halves until they fit.
        Returns the chunk's length, 0 when not one token's fit this step."""
        if not self.cache.windowed:
            return n
        while n:
            try:
                self.cache.alloc_window(st, st.computed + n)
                return n
            except CacheFull:
                n //= 2
        return 0

    def _grow(self, st: RequestState, done: list[Request]) -> bool:
        """Pages for the token a decoding request is about to compute. On a shortfall the
        newest decoding request is preempted (its work is cached, it re-queues at the
        front) until this one fits; False when this one was preempted itself."""
        while True:
            try:
                if st.allocated < len(st.tokens):
                    self.cache.append_tokens(st, st.tokens[st.allocated:])
                return True
            except CacheFull:
                victim = next((s for s in reversed(self.running) if s.allocated <= s.computed), st)
                if victim is st and len(self.running) == 1 and not self.prefetching:
                    self.running.remove(st)
                    self.cache.release(st)
                    self._fail(st.owner, f"request {st.owner.rid} can never fit: the pools cannot "
                                         f"hold {len(st.tokens)} tokens")
                    done.append(st.owner)
                    return False
                self._preempt(victim, done)
                if victim is st:
                    return False

    def _preempt(self, st: RequestState, done: list[Request]) -> None:
        self.running.remove(st)
        try:
            self._store(st)
        except Exception as e:
            self._abort(st, e, done)
            return
        st.clear()
        st.owner.status = "preempted"
        st.owner.metrics.preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.appendleft(st)

    def _input(self, st: RequestState, n: int) -> PagedInput:
        s, e, P = st.computed, st.computed + n, self.page_size
        if self.captures and P > 1 and e >= st.prompt_len and e % P == 0 and e not in st.checkpoints:
            # the rolling decode checkpoint moves to each page boundary it passes
            if st.rolling is not None:
                st.checkpoints[e] = st.checkpoints.pop(st.rolling)
                st.rolling = e
            elif self._checkpoint(st, e) is not None:
                st.rolling = e
        # logits only where they are used: the last row of a chunk that reaches the end of
        # the request's tokens (its prompt's last, or a decode token), and the rows that
        # score the prompt tokens whose logprobs were asked for
        rows = 1 if e == len(st.tokens) else 0
        first = _first_scoring_row(st, s, e)
        if first is not None:
            rows = max(rows, e - first)
        return PagedInput(st.tokens[s:e], s, st.pages, st.state_slot, st.captures(s, e), logit_rows=rows,
                          greedy=first is None and argmax_only(st.owner))

    def _advance(self, st: RequestState, inp: PagedInput, logits: torch.Tensor, done: list[Request]) -> None:
        if st.spec is not None and st.spec.pending is not None:
            self._verify(st, inp, logits, done)
            return
        req = st.owner
        n = len(inp.tokens)
        prefill = min(st.computed + n, st.prompt_len) - min(st.computed, st.prompt_len)
        req.metrics.computed_tokens += prefill
        self.counters["prefill_tokens"] += prefill
        self.counters["decode_tokens"] += n - prefill
        if _first_scoring_row(st, inp.start, inp.end) is not None:
            _record_prompt_logprobs(st, inp, logits, self._logprobs)
        st.computed += n
        if self.cache.windowed:
            if prefill and self.keeps_windows:  # the prompt's windows stay cached as spares
                try:
                    self.cache.cache_behind_window(st, st.computed)
                except Exception as e:
                    self._abort(st, e, done)
                    return
            self.cache.release_out_of_window(st, st.computed)
        if st.computed < len(st.tokens):
            return  # a prefill chunk short of the end: no logits were computed for it
        row = logits[-1]
        if self._take(st, self._choose(st, row), row):
            self._finish(st, time.perf_counter(), done)

    def _take(self, st: RequestState, tok: int, row: torch.Tensor) -> bool:
        """A new token from its row of logits: recorded, its logprobs, appended; True when
        it ends the request (a stop id or string, the length), with the reason set."""
        req = st.owner
        if req.record_logits:
            req.logits.append(row.detach().to("cpu", copy=True))
        if req.logprobs is not None:
            req.output_logprobs.append(self._logprobs(row, tok, req.logprobs))
        if req.metrics.first_token is None:
            req.metrics.first_token = time.perf_counter()
        req.output_ids.append(tok)
        st.tokens.append(tok)
        req.metrics.output_tokens = len(req.output_ids)
        if tok in req.sampling.stop_set:
            req.finish_reason, req.matched_stop = "stop", tok
        elif req.sampling.stop and (hit := self._stop_string(req)) is not None:
            req.finish_reason, req.matched_stop = "stop", hit
        elif len(req.output_ids) >= req.sampling.max_new_tokens:
            req.finish_reason = "length"
        else:
            return False
        return True

    def _finish(self, st: RequestState, now: float, done: list[Request]) -> None:
        """A request that ended: its tokens to the cache, its status set."""
        req = st.owner
        self.running.remove(st)
        self._store(st, req.session_id)
        req.status = "finished"
        req.metrics.finished = now
        self.counters["finished"] += 1
        done.append(req)

    def _choose(self, st: RequestState, row: torch.Tensor) -> int:
        """The next token from its row of logits (a replay takes the logged one instead)."""
        return sample(row, st.owner.sampling, st.rng)

    def _logprobs(self, row: torch.Tensor, token: int, top: int):
        """A token's logprob and the top alternatives (a replay has no values: None)."""
        return token_logprobs(row, token, top)

    def _stop_string(self, req: Request) -> str | None:
        """The stop string the newest token completed, if any: it lies in the text of the
        last `stop_tail` tokens (a token is at least one byte)."""
        sp = req.sampling
        tail = self.tokenizer.decode(req.output_ids[-sp.stop_tail:])
        return next((s for s in sp.stop if s in tail), None)

    def _store(self, st: RequestState, session_id=None) -> None:
        """Hand the request's computed tokens to the tree (or free them with the cache off)."""
        if not self.use_cache:
            self.cache.release(st)
            return
        if st.computed < st.allocated:  # preempted while prefilling: what it computed, where a resume can use it
            p = self.cache.shareable(st, st.computed)
            if p:
                self.cache.cache_unfinished(st, upto=p)
            self.cache.release(st)
            return
        if st.allocated < st.computed:  # their pages are there: no allocation
            self.cache.append_tokens(st, st.tokens[st.allocated:st.computed])
        self.cache.cache_finished(st, session_id)
        if self.storage is not None:
            self.storage.write_through(st)


def argmax_only(req: Request) -> bool:
    """Whether a request uses its logits only for their argmax (greedy, no logprobs, no
    recorded logits): then the model may hand back the tokens (PagedInput.greedy)."""
    return req.sampling.greedy and req.logprobs is None and not req.record_logits


def _first_scoring_row(st: RequestState, s: int, e: int) -> int | None:
    """The first position in [s, e) whose row scores a prompt token still owed to the
    request's prompt logprobs (row q scores the token at q + 1), or None."""
    req = st.owner
    p = req.prompt_logprobs_from
    if p is None:
        return None
    n = len(req.input_ids)
    first = max(s, p - 1 + len(req.prompt_logprobs), 0)
    return first if first < min(e, n - 1) else None


def _record_prompt_logprobs(st: RequestState, inp, logits: torch.Tensor, score) -> None:
    """The prompt logprobs this chunk's rows give, in order, each once (a preempted
    request that computes them again adds nothing)."""
    req = st.owner
    p, ids, k = req.prompt_logprobs_from, req.input_ids, req.logprobs or 0
    if p == 0 and not req.prompt_logprobs:
        req.prompt_logprobs.append(None)  # nothing predicts the first token
    row0 = inp.end - logits.shape[0]  # the position of the first row computed
    for q in range(max(row0, p - 1 + len(req.prompt_logprobs)), min(inp.end, len(ids) - 1)):
        if q + 1 - p == len(req.prompt_logprobs):
            req.prompt_logprobs.append(score(logits[q - row0], ids[q + 1], k))
