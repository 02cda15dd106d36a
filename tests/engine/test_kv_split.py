"""The KV budget and its split (engine.build.kv_split): --max-total-tokens tokens in
every KV layer, as SGLang reads it; the window pools take what their ratio or the
workload says, FULL takes the most pages the rest of the budget buys, and the start-up
line says how it was split."""
import pytest

from uniradix.config import CacheConfig
from uniradix.engine import Engine
from uniradix.engine.build import describe_split, kv_split
from uniradix.model import load_model

GEMMA = load_model("gemma3-like")  # one FULL layer and five SWA layers


def cost(split, full_pages, window_pages):
    return full_pages * split.page_bytes["full"] + window_pages * split.page_bytes["swa"]


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.1])
def test_a_given_ratio_splits_the_budget_as_sglang_does(page, ratio):
    split = kv_split(GEMMA, CacheConfig(page_size=page, max_total_tokens=4096, swa_full_tokens_ratio=ratio),
                     max_running=4)
    F, S = split.sizes["full"][0], split.sizes["swa"][0]
    assert S == int(F * ratio)
    assert split.budget == 4096 // page * (split.page_bytes["full"] + split.page_bytes["swa"])
    assert cost(split, F, S) <= split.budget < cost(split, F + 1, int((F + 1) * ratio))  # the most FULL it buys
    if ratio == 1.0:
        assert F == S == 4096 // page   # 1:1: every layer keeps --max-total-tokens, as before
    else:
        assert F > 4096 // page         # what the windows do not keep goes to FULL


@pytest.mark.parametrize("page", [1, 4])
def test_derived_window_pool_is_the_workloads_need_and_full_takes_the_rest(page):
    cfg = CacheConfig(page_size=page, max_total_tokens=4096)
    split = kv_split(GEMMA, cfg, max_running=4, chunk=64)
    F, S = split.sizes["full"][0], split.sizes["swa"][0]
    spec = split.specs["swa"]
    need = split.demand["swa"]
    assert need["running"] == 4 * spec.window_pages(page) and need["chunk"] == -(-64 // page) + 1
    assert need["cached"] == -(-F // spec.CACHED_WINDOWS)
    assert S == sum(need.values()) < F
    assert cost(split, F, S) <= split.budget
    line = describe_split(split)
    assert "derived" in line and f"FULL {F * page:,} tokens" in line and f"SWA {S * page:,} tokens" in line
    # more running requests, more windows: less FULL out of the same budget
    more = kv_split(GEMMA, cfg, max_running=16, chunk=64)
    assert more.sizes["swa"][0] > S and more.sizes["full"][0] < F


def test_the_engine_builds_the_split_it_says_and_serves_within_it():
    eng = Engine("gemma3-like", max_total_tokens=2048, max_running_requests=2)
    split = kv_split(eng.model, eng.config.cache, max_running=2, chunk=eng.chunk)
    assert eng.pools["full"].size == split.sizes["full"][0] and eng.pools["swa"].size == split.sizes["swa"][0]
    assert eng.pools["full"].size > 2048 > eng.pools["swa"].size
    eng.close()


def test_a_model_without_windows_keeps_full_at_the_budget():
    split = kv_split(load_model("full-only"), CacheConfig(max_total_tokens=1000), max_running=4)
    assert split.sizes["full"][0] == 1000 and set(split.page_bytes) == {"full"}


def test_a_window_pool_too_small_for_one_window_is_refused():
    with pytest.raises(ValueError, match="fewer than one .*-token window and a page"):
        kv_split(GEMMA, CacheConfig(max_total_tokens=4096, swa_full_tokens_ratio=0.0001), max_running=1)
