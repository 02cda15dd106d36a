"""The SWA window rule end to end (design.md §3 SWA): a query at i reads keys i - W < j <= i,
so a request resumes at boundary b with the SWA KV of the W - 1 tokens before b, and the
tree keeps exactly that much at the end of each cached sequence, its junction and its
prompt's resume point, and with spare windows (the default, without recurrent layers)
every page of each prompt computed besides.

Each case runs an engine with a layer pattern holding sliding layers, at page sizes 1,
2, 3, 4 and 16 and windows with W % P in {0, 1, 2, P - 1} (W = 1 included): a
multi-turn conversation and branches off it. Logits equal the oracle's, every handle
is owned once after every step, and reuse reaches exactly the depth an independent
model of the rule allows, with the tree holding exactly the SWA pages that model says
are retained (no page more: at W % P == 1 the old `b - W` rule kept one per window)."""
from __future__ import annotations

import random

import pytest

from engine_checks import (check_exact, check_ownership, check_work, diverging, greedy, page_floor,
                           run_checked, toks)
from helpers import SWEEP_PAGES, WINDOW_CASES  # tests/tree: engine_checks puts it on sys.path
from uniradix.model import HybridConfig


# the default run: every remainder class, W = 1 included, at small and large pages
QUICK = [(1, 1), (1, 3), (2, 3), (2, 4), (3, 2), (3, 4), (3, 6), (4, 1), (4, 5), (4, 6), (4, 7), (4, 8),
         (16, 16), (16, 17), (16, 18), (16, 31)]


class Retained:
    """What the cache should hold after each request, read off design.md §3 alone (no tree
    code): FULL for every computed page; SWA for the pages touching
    [max(0, j - W + 1), j) at each position j a later request may resume at (the end of
    the cached tokens, the junction, the prompt's resume point); a checkpoint at those
    positions past where the request resumed. Pages and checkpoints are named by the
    tokens up to their end, so a shared prefix is one name."""

    def __init__(self, cfg: HybridConfig, P: int, retention: str = "spare"):
        self.P, self.W = P, cfg.window
        self.sliding, self.recurrent = "S" in cfg.pattern, "M" in cfg.pattern
        # spare windows: a window without a checkpoint beside it resumes nothing, and W = 1
        # reads no earlier page
        self.spare = retention == "spare" and self.sliding and not self.recurrent and self.W > 1
        self.paths: list[list[int]] = []
        self.swa: set[tuple] = set()
        self.ckpt: set[tuple] = set()

    def window_pages(self, toks: list[int], j: int) -> set[tuple]:
        """Names of the pages touching [max(0, j - W + 1), j) of toks."""
        P, lo = self.P, max(0, j - self.W + 1)
        return {tuple(toks[:(q + 1) * P]) for q in range(j // P) if (q + 1) * P > lo}

    def matched(self, prompt: list[int]) -> int:
        """Page-aligned common prefix of all but the last prompt token with a cached path."""
        best = 0
        for p in self.paths:
            k = 0
            for x, y in zip(prompt[:-1], p):
                if x != y:
                    break
                k += 1
            best = max(best, k)
        return page_floor(best, self.P)

    def valid(self, prompt: list[int], b: int) -> bool:
        if b == 0:
            return True
        if self.sliding and not self.window_pages(prompt, b) <= self.swa:
            return False
        return not self.recurrent or tuple(prompt[:b]) in self.ckpt

    def boundary(self, prompt: list[int]) -> tuple[int, int]:
        """(matched, the deepest boundary the rule accepts)."""
        m = self.matched(prompt)
        return m, max(b for b in range(0, m + 1, self.P) if self.valid(prompt, b))

    def finished(self, req, matched: int, b: int) -> None:
        P = self.P
        done = list(req.input_ids) + list(req.output_ids[:-1])  # what the request computed
        n = page_floor(len(done), P)
        resume = page_floor(len(req.input_ids) - 1, P)
        self.paths.append(done[:n])
        for j in {n, matched, resume}:
            if j > 0:
                self.swa |= self.window_pages(done, j)
            if j > b:
                self.ckpt.add(tuple(done[:j]))
        if self.spare:  # every whole page it computed of its prompt's all but last token (what it matched)
            self.swa |= {tuple(done[:(q + 1) * P]) for q in range(b // P, (len(req.input_ids) - 1) // P)}


def _serve(eng, model: Retained, prompt: list[int], out: int):
    """Run one request, checked: exact logits, ownership after every step, reuse and
    retention as the model says."""
    matched, want = model.boundary(prompt)
    req = greedy(prompt, out)
    run_checked(eng, [req])
    check_exact(eng, req)
    check_work(req)
    assert req.metrics.cached_tokens == want, (
        f"resumed at {req.metrics.cached_tokens}, the rule accepts {want} (matched {matched})")
    model.finished(req, matched, want)
    tree = eng.cache.tree
    if model.sliding:
        held = tree.size[tree.index["swa"]]
        assert held == len(model.swa), f"the tree holds {held} SWA pages, the retention windows {len(model.swa)}"
    check_ownership(eng)
    return req


def _conversation(make_engine, pattern: str, P: int, W: int, seed: int, retention: str = "spare") -> None:
    cfg = HybridConfig(pattern=pattern, window=W)
    eng = make_engine(cfg, page_size=P, swa_retention=retention)
    model = Retained(cfg, P, retention)
    rng = random.Random(seed)
    # turn 1, and turn 2 extending its prompt and output
    first = toks(rng, 2 * P + W + 3)
    a = _serve(eng, model, first, P + 2)
    second = first + a.output_ids + toks(rng, P + 1)
    b = _serve(eng, model, second, 3)
    assert b.metrics.cached_tokens == page_floor(len(first) + len(a.output_ids) - 1, P)
    # branches off turn 2 at page-aligned points: inside the end window of turn 1, just
    # past the first page, and one page before turn 2's cached end
    done = second + b.output_ids[:-1]
    n2 = page_floor(len(done), P)
    for k in sorted({page_floor(len(first) + len(a.output_ids) - 1, P) - P, P, n2 - P}):
        if 0 < k < len(done):
            _serve(eng, model, done[:k] + diverging(rng, P + 2, [done[k]]), 2)


RETENTIONS = pytest.mark.parametrize("pattern,retention", [("SF", "spare"), ("SF", "windows"), ("FSMF", "spare")])


@RETENTIONS
@pytest.mark.parametrize("P,W", QUICK)
def test_reuse_and_retention_follow_the_window_rule(make_engine, pattern, retention, P, W):
    _conversation(make_engine, pattern, P, W, seed=P * 100 + W, retention=retention)


@pytest.mark.slow
@pytest.mark.parametrize("pattern,retention", [("SF", "spare"), ("SF", "windows"), ("FSMF", "spare"),
                                               ("SSSSSF", "spare"), ("SSSSSF", "windows")])
@pytest.mark.parametrize("P,W", WINDOW_CASES)
def test_reuse_and_retention_follow_the_window_rule_sweep(make_engine, pattern, retention, P, W):
    _conversation(make_engine, pattern, P, W, seed=P * 1000 + W, retention=retention)


def test_window_one_resumes_anywhere_without_swa(make_engine):
    """W = 1 reads no earlier token: the tree keeps no SWA page, and a branch off the
    middle of a cached sequence resumes at the branch point (FULL alone decides)."""
    P = 4
    eng = make_engine(HybridConfig(pattern="SF", window=1), page_size=P)
    rng = random.Random(7)
    trunk = toks(rng, 6 * P)
    first = greedy(trunk, 2)
    run_checked(eng, [first])
    check_exact(eng, first)
    assert eng.cache.tree.size[eng.cache.tree.index["swa"]] == 0
    k = 3 * P
    req = greedy(trunk[:k] + diverging(rng, 5, [trunk[k]]), 2)
    run_checked(eng, [req])
    check_exact(eng, req)
    assert req.metrics.cached_tokens == k


def test_the_sweep_covers_the_remainders():
    """Every page size has windows with W % P in {0, 1, 2, P - 1}, and W = 1."""
    for P in SWEEP_PAGES:
        ws = [W for p, W in WINDOW_CASES if p == P]
        assert 1 in ws
        assert {W % P for W in ws} == {0, 1 % P, 2 % P, (P - 1) % P}
    assert set(QUICK) <= set(WINDOW_CASES)
    for P in SWEEP_PAGES:
        assert {W % P for p, W in QUICK if p == P} == {W % P for p, W in WINDOW_CASES if p == P}
