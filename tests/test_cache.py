"""UnifiedRadixCache: the request lifecycle, eviction on shortfall, copy-on-write
checkpoints, sessions, flush and exact accounting against real pools."""

import pytest
import torch

from uniradix.cache import CacheFull, UnifiedRadixCache, audit
from uniradix.memory import HandleAllocator, KVPool, MambaStatePool
from uniradix.tree import FullComponent, MambaComponent, RadixTree, SWAComponent


def seq(n, base=1000):
    return list(range(base, base + n))


def make(full=64, swa=None, window=4, mamba=None, page=1, accounting=True):
    comps = [FullComponent()]
    pools = {"full": KVPool([0], full, page, 1, 2, accounting_only=accounting, name="full")}
    if swa:
        comps.append(SWAComponent(window))
        pools["swa"] = KVPool([1], swa, page, 1, 2, accounting_only=accounting, name="swa")
    if mamba:
        comps.append(MambaComponent())
        pools["mamba"] = MambaStatePool([2], mamba, (3,), (2, 2), accounting_only=accounting)
    return UnifiedRadixCache(RadixTree(comps, page_size=page), pools)


def check_accounting(cache, live=()):
    """Every handle is free, owned by a live request, or held by the tree: exactly once
    (the library's audit)."""
    audit(cache, live)


def serve(cache, tokens, session=None, **kw):
    req = cache.match_prefix(tokens, **kw)
    cache.alloc_request(req)
    req.computed = req.allocated
    cache.cache_finished(req, session_id=session)
    return req


def test_reuse_and_hit_counts():
    cache = make()
    r1 = serve(cache, seq(10))
    r2 = serve(cache, seq(10) + [5, 6])
    assert r1.reused == 0 and r2.reused == 10
    st = cache.stats()
    assert st["hit_tokens"] == 10 and st["prompt_tokens"] == 22
    assert st["components"]["full"]["size"] == 12
    check_accounting(cache)


def test_match_prefix_locks_until_finished():
    cache = make(full=16)
    serve(cache, seq(10))
    req = cache.match_prefix(seq(10) + [1])
    assert req.prefix_len == 10 and cache.tree.locked[0] == 10
    # the locked prefix survives a request that needs everything else
    with pytest.raises(CacheFull, match="locked"):
        cache.alloc(full=10)
    assert cache.tree.size[0] == 10
    cache.alloc_request(req)
    cache.cache_finished(req)
    assert cache.tree.locked[0] == 0
    check_accounting(cache)


def test_alloc_evicts_on_shortfall_and_is_all_or_nothing():
    cache = make(full=16, swa=16)
    serve(cache, seq(12))
    avail = [p.available for p in cache.pools]
    got = cache.alloc(full=10, swa=10)  # needs eviction of the cached sequence
    assert len(got["full"]) == 10 and len(got["swa"]) == 10
    cache.free(**got)
    check_accounting(cache)
    assert [p.available for p in cache.pools] == [16, 16] != avail
    req = cache.match_prefix(seq(12))
    cache.alloc_request(req)
    before = [p.available for p in cache.pools]
    with pytest.raises(CacheFull):
        cache.alloc(full=8, swa=1)  # 4 free, 12 locked: impossible
    assert [p.available for p in cache.pools] == before  # nothing half-taken
    check_accounting(cache, [req])
    cache.release(req)
    check_accounting(cache)


def test_unaligned_tail_is_freed_and_not_cached():
    cache = make(full=32, page=4)
    req = serve(cache, seq(10))
    assert cache.tree.size[0] == 2 and cache.pools[0].available == 30
    assert not req.held
    check_accounting(cache)


def test_checkpoint_is_copied_on_write():
    cache = make(full=32, mamba=4, accounting=False)
    pool = cache.pools[cache.tree.index["mamba"]]
    req = cache.match_prefix(seq(8))
    assert req.reused == 0 and req.state_slot is not None
    cache.alloc_request(req)
    pool.state(2)[req.state_slot].fill_(3.0)
    req.computed = 8
    cache.cache_finished(req)
    ck = cache.tree.match(seq(8)).handles["mamba"][0]
    req2 = cache.match_prefix(seq(8) + [1, 2])
    assert req2.reused == 8 and req2.state_slot != ck
    assert torch.equal(pool.state(2)[req2.state_slot], torch.full((2, 2), 3.0))
    pool.state(2)[req2.state_slot].fill_(-1.0)  # the request mutates its copy
    assert torch.equal(pool.state(2)[ck], torch.full((2, 2), 3.0))  # the checkpoint does not move
    cache.release(req2)
    check_accounting(cache)


def test_state_not_at_a_page_boundary_is_not_cached():
    cache = make(full=32, mamba=4, page=4)
    req = cache.match_prefix(seq(10))
    cache.alloc_request(req)
    req.computed = 10  # the state has absorbed 10 tokens: no page boundary
    cache.cache_finished(req)
    # without a checkpoint at 8 the leaf is useless and goes at once
    assert cache.tree.size == [0, 0] and cache.pools[0].available == 32
    check_accounting(cache)


def test_junction_checkpoint_lets_the_next_branch_resume():
    cache = make(full=64, mamba=8)
    serve(cache, seq(8) + [1] * 4)
    req = cache.match_prefix(seq(8) + [2] * 4)
    assert (req.reused, req.junction) == (0, 8)
    cache.add_checkpoint(req, 8)
    cache.alloc_request(req)
    req.computed = req.allocated
    cache.cache_finished(req)
    assert cache.match_prefix(seq(8) + [3] * 4).reused == 8


def test_cache_unfinished_moves_the_lock_and_keeps_the_request_going():
    cache = make(full=32)
    serve(cache, seq(6))
    req = cache.match_prefix(seq(10))
    cache.alloc_request(req)
    old = req.receipt
    cache.cache_unfinished(req)
    assert old.released and req.receipt.node.end == 10 and req.prefix_len == 10
    assert cache.tree.locked[0] == 10
    assert list(req.pages["full"]) == list(cache.tree.match(seq(10)).handles["full"])
    cache.append_tokens(req, [7, 7])
    assert len(req.pages["full"]) == 12
    check_accounting(cache, [req])
    cache.cache_finished(req)
    assert cache.tree.locked[0] == 0 and cache.tree.size[0] == 12
    check_accounting(cache)


def test_out_of_window_swa_pages_are_freed_except_the_junction_window():
    cache = make(full=64, swa=64, window=4)
    serve(cache, seq(8) + [1] * 8)
    req = cache.match_prefix(seq(8) + [2] * 2)
    assert (req.reused, req.junction) == (0, 8)
    cache.alloc_request(req)
    cache.append_tokens(req, [3] * 10)  # 20 tokens
    swa = req.pages["swa"]
    kept_before = [p for p in range(20) if swa[p] >= 0]
    assert kept_before == list(range(20))
    freed = cache.release_out_of_window(req)
    kept = [p for p in range(20) if swa[p] >= 0]
    assert kept == [5, 6, 7] + [17, 18, 19]  # junction window, current window
    assert freed == 14
    check_accounting(cache, [req])
    cache.cache_finished(req)
    check_accounting(cache)


def test_resume_points_keep_their_window_while_decoding_and_in_the_tree():
    cache = make(full=64, swa=64, window=4)
    req = cache.match_prefix(seq(10))
    req.resume_points.append(9)  # e.g. all but the last prompt token
    cache.alloc_request(req)
    cache.append_tokens(req, [3] * 10)  # 20 tokens
    assert cache.release_out_of_window(req, upto=12) == 6  # [0, 6): before 9's window
    cache.release_out_of_window(req)
    swa = req.pages["swa"]
    assert [p for p in range(20) if swa[p] >= 0] == [6, 7, 8] + [17, 18, 19]
    check_accounting(cache, [req])
    cache.cache_finished(req)
    check_accounting(cache)
    assert cache.match_prefix(seq(9)).reused == 9


def test_sessions_keep_referenced_data_longest():
    cache = make(full=24)
    serve(cache, seq(8, base=0), session="s1")
    serve(cache, seq(8, base=100))
    serve(cache, seq(8, base=200))
    serve(cache, seq(8, base=300))  # evicts the oldest unreferenced one
    assert cache.match_prefix(seq(8, base=0)).reused == 8
    assert cache.close_session("s1")


def test_flush_refused_while_locked_then_empties_everything():
    cache = make(full=32, swa=32, mamba=4)
    serve(cache, seq(8), session="a")
    req = cache.match_prefix(seq(8))
    assert not cache.flush()
    cache.release(req)
    assert cache.flush()
    assert cache.tree.size == [0, 0, 0] and cache.tree.num_nodes == 0
    assert [p.available for p in cache.pools] == [32, 32, 4]


def test_salted_requests_do_not_share():
    cache = make()
    serve(cache, seq(8), salt="a")
    assert cache.match_prefix(seq(8), salt="b").reused == 0


def test_missing_pool_is_a_clear_error():
    with pytest.raises(ValueError, match="no pool"):
        UnifiedRadixCache(RadixTree([FullComponent(), MambaComponent()]), {"full": HandleAllocator(4)})


def test_append_tokens_that_do_not_fit_leave_the_request_unchanged():
    cache = make(full=8)
    req = cache.match_prefix(seq(6), alloc=True)
    with pytest.raises(CacheFull):
        cache.append_tokens(req, [1, 2, 3])  # 9 pages, 8 exist
    assert req.allocated == 6 and len(req.pages["full"]) == 6
    cache.append_tokens(req, [1, 2])
    assert req.allocated == 8 and len(req.pages["full"]) == 8
    cache.cache_finished(req)
    check_accounting(cache)
