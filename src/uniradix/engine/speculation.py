"""Speculative decoding: a decoding request's drafts verified with it in one step.

A decoding request computes one token a step, and a step reads every weight once
whatever its rows, so where a reply repeats what came before (code, a quoted document, a
tool's output echoed back) the engine drafts the continuation and verifies it: the
request's last token and k drafts go through the paged forward as one chunk with logits
on all k + 1 rows, and the longest run of drafts the model itself would have produced is
kept, with the model's own next token after it. Nothing a client sees changes but speed:
greedy replies are the same tokens (each row's logits are the same bits as a one-row
decode step: the row-invariant kernels), sampled ones the same distribution (a
deterministic draft d is kept with the model's probability of d, else the token is drawn
from the model's distribution with d taken out).

The cache sees accepted tokens only. Drafts live inside one step: their pages and the
recurrent states the chunk captures at each position come from free handles
(`UnifiedRadixCache.draft`: a draft never evicts what is cached), and `rollback` gives
back what the rejected drafts used before the step ends, keeping the recurrent state at
the accepted length and the decode checkpoint at the page boundary a one-token-a-step
decode would have kept. Between steps a request is exactly as without speculation, so
preemption, sessions, in-batch sharing and the tiers' writes see what they always saw.

Drafts. NGRAM (`PromptLookup`): the continuation of the request's last tokens where
they occurred before in its own prompt and output (vLLM's and llama.cpp's prompt lookup,
SGLang's NGRAM flags): the earlier occurrence that matches the most of its last tokens
(up to --speculative-ngram-max-match-window-size), the newest among equals; where that
continuation reaches the end (the reply repeats itself), it goes on repeating. SUFFIX:
the continuation of its last GRAM tokens anywhere in what the cache holds for its
tenant, the most used one (tree/drafts.py: an index over the tree's own spans, kept in
step by the tree): the cache that saves prefill also drafts decode.
NGRAM+SUFFIX: the first where its match holds GRAM tokens, else the second.

How many drafts. A verify row costs a share of a step (its compute: the step reads every
weight once whatever its rows), and the d-th draft pays only when every draft before it
is kept too. Each request keeps how its drafts went (kept drafts, and verifies that ended
at a rejected one, both decaying), which makes a the chance that a draft is kept given
the one before it was: it drafts while a^d is at least ROW_COST (more in a batch, where
each row buys less of the step: `draft_bar`), so a request that keeps what it drafts (a
file re-emitted, a document quoted) drafts long and one that does not drafts short, at
most --speculative-num-draft-tokens, the tokens the reply has left, its share of the
step's draft budget (--chunked-prefill-size, split evenly among the decoding requests)
and what the free handles hold (`_room_for`: the longest half that fits). Whether to
draft at all is the first draft's question (one more row for a token it keeps with some
chance: worth it above ROW_COST), so a request whose first draft keeps being rejected
stops drafting for a while (a pause that doubles each time) and plain chat is not
slowed by speculation, while one whose long drafts fail late drafts shorter instead (the
length rule)."""
from __future__ import annotations

import time

import torch

from ..cache import CacheFull, RequestState
from ..model import PagedInput
from ..tree import encode
from ..tree.drafts import GRAM
from .sampling import accept_draft

#: earlier occurrences of the last min-n tokens compared, newest first
CANDIDATES = 64
#: below this share of verifies that keep their first draft (a moving average), a
#: request pauses drafting
LOW_ACCEPTANCE = 0.3
#: the longest pause, in decode steps
MAX_PAUSE = 64
#: what one more row of a verify chunk costs, as a share of a one-row decode step (its
#: compute; measured 0.07-0.16 a row at 4-16 rows on the CPUs docs/benchmarks.md names and precisions):
#: a draft is worth its row while the chance that it is kept is at least this
ROW_COST = 0.1
#: how much of a request's draft record each verify keeps (the rest is forgotten)
MEMORY = 0.8


def tokens_a_verify(kept: int, verifies: int) -> float | None:
    """The tokens a verify step yields on average: its kept drafts and the model's own
    token after them (SGLang's accept length); None before the first verify."""
    return (kept + verifies) / verifies if verifies else None


def draft_bar(rows: int) -> float:
    """The chance of being kept a draft needs, in a step of `rows` one-token rows: its
    row costs ROW_COST of a one-row step, and the step without it yields `rows` tokens in
    1 + ROW_COST * (rows - 1) of one, so a draft pays where it adds at least its share of
    that (ROW_COST alone, at one row; more as the batch grows)."""
    rows = max(1, rows)
    return ROW_COST * rows / (1 + ROW_COST * (rows - 1))


class PromptLookup:
    """Where each run of `min_n` tokens occurred in a request's tokens (the positions
    that followed it, oldest first), indexed as tokens arrive, and the draft for the
    current end: the continuation of the earlier occurrence that matches the most of the
    last tokens (at most `max_n`)."""

    __slots__ = ("min_n", "max_n", "where", "seen", "matched")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.where: dict[tuple, list[int]] = {}
        self.seen = 0  # continuations indexed: positions [min_n, seen)
        self.matched = 0  # tokens the last draft's match held

    def _index(self, tokens: list[int]) -> None:
        n = self.min_n
        for i in range(max(self.seen, n), len(tokens)):
            self.where.setdefault(tuple(tokens[i - n:i]), []).append(i)
        self.seen = max(self.seen, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `tokens` (empty when its end never occurred
        before)."""
        n, L = self.min_n, len(tokens)
        self.matched = 0
        if k <= 0 or L <= n:
            return []
        self._index(tokens)
        found = self.where.get(tuple(tokens[L - n:]))
        if not found:
            return []
        best, at = 0, -1
        for pos in reversed(found[-CANDIDATES:]):  # pos: the token that followed an earlier occurrence
            if pos >= L:
                continue
            m = n
            while m < self.max_n and pos - 1 - m >= 0 and tokens[pos - 1 - m] == tokens[L - 1 - m]:
                m += 1
            if m > best:
                best, at = m, pos
                if m == self.max_n:
                    break
        self.matched = best
        out = tokens[at:at + k]
        while len(out) < k:  # the occurrence runs into the end: a repeating run goes on repeating
            out.append(out[len(out) - (L - at)])
        return out


class Drafting:
    """A request's speculation: its drafter, the drafts of the step in flight, and how
    well its drafts do: the drafts kept and the verifies that ended at a rejected draft
    (decaying counts, a prior of one each: how long to draft), and a moving average of
    the verifies that kept their first draft, with a pause (whether to draft: a verify
    of 16 drafts that keeps 2 paid for its first row, though it kept an eighth)."""

    __slots__ = ("lookup", "pending", "kept", "lost", "rate", "pause", "wait")

    def __init__(self, lookup: PromptLookup) -> None:
        self.lookup = lookup
        self.pending: list[int] | None = None
        self.kept = self.lost = 1.0
        self.rate = 1.0
        self.pause = 0   # the next pause's length, in steps
        self.wait = 0    # steps left before drafting again

    def length(self, k: int, bar: float = ROW_COST) -> int:
        """The drafts worth verifying, at most k: the most d with a^d >= bar, where a is
        the chance that a draft is kept after a kept one (kept / (kept + lost), the
        geometric run's estimate); at least one."""
        a = self.kept / (self.kept + self.lost)
        d = 1
        while d < k and a ** (d + 1) >= bar:
            d += 1
        return d

    def judged(self, drafted: int, accepted: int) -> None:
        self.kept = MEMORY * self.kept + accepted
        self.lost = MEMORY * self.lost + (accepted < drafted)
        self.rate = 0.7 * self.rate + 0.3 * (accepted > 0)
        if self.rate < LOW_ACCEPTANCE:
            self.pause = min(MAX_PAUSE, max(1, 2 * self.pause))
            self.wait = self.pause
            self.rate = LOW_ACCEPTANCE  # drafting again after the pause starts from the threshold
        elif accepted:
            self.pause = 0


class Speculation:
    """Engine's speculative decoding (a mixin: the state lives on the engine; `self.spec`
    is the SpeculativeConfig, or None when it is off)."""

    def _add_drafts(self, batch: list) -> list:
        """The step's batch with each decoding request that has drafts turned into a
        verify chunk: its last token and the drafts, logits on every row. Run after every
        other request has its pages for the step, and from free handles only, so that
        speculation takes nothing the step would otherwise have had. A step's drafts
        number at most --chunked-prefill-size, each decoding request drafting at most an
        even share of what the ones before it left (so a large draft count or batch cannot
        make a step of thousands of logits rows)."""
        out = []
        self.draft_bar = draft_bar(sum(len(inp.tokens) == 1 for _, inp in batch))
        decoding = sum(len(inp.tokens) == 1 and inp.start >= st.prompt_len for st, inp in batch)
        budget = self.chunk  # the step's drafts: at most a prefill chunk's tokens, shared
        for st, inp in batch:
            drafts = []
            if len(inp.tokens) == 1 and inp.start >= st.prompt_len:
                self.draft_room = budget // decoding  # an even share of what is left
                decoding -= 1
                sp = st.spec
                if sp is None:
                    cfg = self.spec
                    sp = st.spec = Drafting(PromptLookup(cfg.speculative_ngram_min_match_window_size,
                                                         cfg.speculative_ngram_max_match_window_size))
                if sp.wait:
                    sp.wait -= 1
                elif self.draft_room:
                    drafts = self._drafts(st)[:self.draft_room]
            if drafts:
                drafts, captures = self._room_for(st, drafts)
                if drafts:
                    budget -= len(drafts)
                    st.spec.pending = drafts
                    end = inp.start + 1 + len(drafts)
                    inp = PagedInput(inp.tokens + drafts, inp.start, st.pages, st.state_slot,
                                     {**captures, **st.captures(inp.start, end)}, logit_rows=1 + len(drafts),
                                     greedy=inp.greedy)
            out.append((st, inp))
        return out

    def _room_for(self, st: RequestState, drafts: list[int]) -> tuple[list[int], dict]:
        """The drafts the free handles have room for, and their captures: all of them, else
        the longest half that fits (a draft's page, and its recurrent state's scratch slot
        where the model has one, come from free handles only), else none. Each halving
        counts in spec_no_room (/metrics: spec_decode_drafts_cut)."""
        while drafts:
            try:
                return drafts, self.cache.draft(st, drafts)
            except CacheFull:
                self.counters["spec_no_room"] += 1
                drafts = drafts[:len(drafts) // 2]
        return [], {}

    def _drafts(self, st: RequestState) -> list[int]:
        """The drafts of a decoding request this step, at most what its reply has room
        for after the verify's own next token: its prompt lookup's (NGRAM), the cache's
        (SUFFIX), or the first where its match holds GRAM tokens or more, else the
        second (NGRAM+SUFFIX)."""
        req = st.owner
        room = req.sampling.max_new_tokens - len(req.output_ids) - 1
        if room <= 0:
            return []
        k = st.spec.length(min(self.spec.speculative_num_draft_tokens, room, self.draft_room), self.draft_bar)
        algo = self.spec.speculative_algorithm
        own = st.spec.lookup.propose(st.tokens, k) if algo != "SUFFIX" else []
        if algo == "NGRAM" or (own and st.spec.lookup.matched >= GRAM):
            return own
        index = self.cache.tree.drafts
        if index is None or len(st.tokens) < GRAM:
            return own
        cached = index.propose(self.cache.tree.find_root(st.salt), encode(st.tokens[-GRAM:]), k)
        return cached or own

    def _verify(self, st: RequestState, inp: PagedInput, logits: torch.Tensor, done: list) -> None:
        """Keep the longest run of drafts the model agrees with and its own token after
        them (each judged on its row, in order, and each emitted as a decode step would:
        logprobs, stop ids and strings, the length limit), then roll the request back to
        what it kept."""
        req = st.owner
        sp = st.spec
        drafts, sp.pending = sp.pending, None
        c, k = inp.start, len(drafts)
        kept = good = 0
        finished = False
        for i in range(k + 1):
            row = logits[i]
            draft = drafts[i] if i < k else None
            if req.sampling.greedy:
                tok = self._choose(st, row)
                accepted = tok == draft
            else:
                tok, accepted = accept_draft(row, req.sampling, draft, st.rng)
            kept += 1
            good += accepted
            finished = self._take(st, tok, row)
            if finished or not accepted:
                break
        n = c + kept  # computed now: every kept token but the newest has its KV and state
        self.cache.rollback(st, n, *self._moved_checkpoint(st, c + 1, n))
        st.computed = n
        sp.judged(k, good)
        m = req.metrics
        m.spec_verify_ct += 1
        m.spec_draft_tokens += k
        m.spec_accepted_tokens += good
        cnt = self.counters
        cnt["spec_verify_steps"] += 1
        cnt["spec_draft_tokens"] += k
        cnt["spec_accepted_tokens"] += good
        cnt["decode_tokens"] += kept
        for pos in range(good):
            self.spec_accepted_at[pos] += 1
        if self.cache.windowed:
            self.cache.release_out_of_window(st, st.computed)
        if finished:
            self._finish(st, time.perf_counter(), done)

    def _moved_checkpoint(self, st: RequestState, first: int, n: int) -> tuple:
        """(checkpoint_at, drop) for rollback: the page boundary in (first, n] where a
        decode of one token a step would have moved its rolling checkpoint last (its
        first position, `first`, was a step's end as in plain decode: `_input`)."""
        P = self.page_size
        if not self.captures or P == 1:
            return None, None
        p = n - n % P
        if p <= first or p < st.prompt_len or p in st.checkpoints:
            return None, None
        drop, st.rolling = st.rolling, p
        return p, drop
