"""Every mix of layer kinds goes through every tier. A model with no full-attention
layer still has a FULL component (it shapes the tree) over a pool that only counts;
nothing above the tree may assume that pool holds data. Each mix is served from the
device (L1), from the host tier after the device evicted it (L2), and by a fresh
engine from shared storage (L3), exact against the oracle, every handle owned once."""
from __future__ import annotations

import random

import pytest
from engine_checks import check_exact, check_work, greedy, page_floor, run_checked, toks

from uniradix.hicache.backends.file import FileBackend
from uniradix.model import HybridConfig

MIXES = ["S", "M", "SM", "MSS", "SF"]


def conversation(eng, rng, turns=2, first=30, new=9, out=4):
    ids, reqs = toks(rng, first), []
    for _ in range(turns):
        r = greedy(ids, out)
        run_checked(eng, [r])
        check_exact(eng, r)
        check_work(r)
        reqs.append(r)
        ids = r.input_ids + r.output_ids + toks(rng, new)
    return reqs, ids


def resumable(r) -> int:
    """Where the next turn resumes: all the request computed, on a page boundary."""
    return len(r.input_ids) + len(r.output_ids) - 1


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("pattern", MIXES)
def test_device_tier(make_engine, pattern, page):
    eng = make_engine(HybridConfig(pattern=pattern), page_size=page, max_total_tokens=1024)
    reqs, _ = conversation(eng, random.Random(1), turns=3)
    for prev, r in zip(reqs, reqs[1:]):
        assert r.metrics.cached_tokens == page_floor(resumable(prev), page)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("pattern", MIXES)
def test_host_tier(make_engine, pattern, page):
    """Turn 1, other traffic until the device evicted it to the host, turn 2 loads it
    back from the host whole."""
    eng = make_engine(HybridConfig(pattern=pattern), page_size=page, max_total_tokens=128,
                      max_mamba_cache_size=8, enable_hierarchical_cache=True, hicache_ratio=8.0)
    rng = random.Random(2)
    (first,), nxt = conversation(eng, rng, turns=1)
    for _ in range(4):
        other = greedy(toks(rng, 40), 3)
        run_checked(eng, [other])
        check_exact(eng, other)
    r = greedy(nxt, 4)
    run_checked(eng, [r])
    check_exact(eng, r)
    check_work(r)
    want = page_floor(resumable(first), page)
    assert r.metrics.cached_tokens == want and r.metrics.host_tokens == want, r.metrics
    assert eng.stats()["errors"] == 0 and eng.cache.stats()["host"]["failed_loads"] == 0


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("pattern", MIXES)
def test_storage_tier(make_engine, tmp_path, pattern, page):
    """What one engine wrote through, a fresh engine over the same store reuses."""
    cfg = HybridConfig(pattern=pattern)
    a = make_engine(cfg, page_size=page, max_total_tokens=1024, storage=FileBackend(str(tmp_path)),
                    prefetch_threshold=1)
    (first,), nxt = conversation(a, random.Random(3), turns=1)
    s = a.stats()
    assert s["storage_saved_objects"] > 0 and s["storage_errors"] == 0, s
    b = make_engine(cfg, page_size=page, max_total_tokens=1024, storage=FileBackend(str(tmp_path)),
                    prefetch_threshold=1)
    r = greedy(nxt, 4)
    run_checked(b, [r])
    check_exact(b, r)
    check_work(r)
    assert r.metrics.storage_tokens == r.metrics.cached_tokens == page_floor(resumable(first), page)
    assert b.stats()["storage_errors"] == 0
    a.close()
    b.close()
