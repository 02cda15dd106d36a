"""build_cache checks every sizing flag before it allocates anything: a value of the
wrong kind, one that would overflow a pool's int32 handles, or sizes whose pools do not
fit the memory where they live raise a ValueError at once that names the flag to
change. ("At once" is checked by construction, not by timing: every pool and allocator
constructor is patched to fail the test.)"""
import pytest
import torch

from uniradix.engine import Engine, build_cache
from uniradix.memory import HandleAllocator, KVPool, MambaStatePool, budget
from uniradix.model import preset

GB = 2**30
TINY = preset("tiny-hybrid")  # F, S and M layers


@pytest.fixture(autouse=True)
def host_memory(monkeypatch):
    """8 GB of host memory available, whatever this machine has."""
    monkeypatch.setattr(budget, "host_available_bytes", lambda *a: 8 * GB)


@pytest.fixture
def nothing_built(monkeypatch):
    def built(self, *a, **kw):
        raise AssertionError(f"{type(self).__name__} was constructed before the sizes were checked")
    for cls in (KVPool, MambaStatePool, HandleAllocator):
        monkeypatch.setattr(cls, "__init__", built)


def refused(flag: str, **kw) -> str:
    kw.setdefault("swa_full_tokens_ratio", 1.0)  # the figures below: every KV layer keeps --max-total-tokens
    with pytest.raises(ValueError) as e:
        build_cache(TINY, **kw)
    assert flag in str(e.value)
    return str(e.value)


# (the flags, what names them) for sizes whose pools need more memory than there is
TOO_BIG = [
    (dict(max_mamba_cache_size=200_000_000), "--max-mamba-cache-size"),
    (dict(max_mamba_cache_size=1_000_000_000), "--max-mamba-cache-size"),
    (dict(max_total_tokens=500_000_000), "--max-total-tokens"),
    (dict(max_total_tokens=20_000_000, swa_full_tokens_ratio=60.0), "--swa-full-tokens-ratio"),
    (dict(enable_hierarchical_cache=True, hicache_ratio=1e5), "--hicache-ratio"),
    (dict(enable_hierarchical_cache=True, hicache_size=100.0), "--hicache-size"),
]


@pytest.mark.parametrize("kw, flag", TOO_BIG)
def test_pools_larger_than_memory_name_the_flag_to_lower(kw, flag, nothing_built):
    msg = refused(flag, **kw)
    assert msg.endswith(f"lower {flag}") or msg.endswith(f"lower {flag} or --max-total-tokens")
    assert "the cpu has 8.0 GB available" in msg


def test_pools_that_fit_alone_but_not_together_are_listed(nothing_built):
    msg = refused("--max-total-tokens", max_total_tokens=10_000_000)
    assert msg.startswith("the pools on the cpu need 7.4 GB in all (the FULL KV pool 4.9 GB for 10000000 pages "
                          "(--max-total-tokens); the SWA KV pool 2.5 GB for 10000000 pages")
    assert msg.endswith("and the cpu has 8.0 GB available (the pools may use 90% of it): lower --max-total-tokens")


def test_the_message_gives_the_figures(nothing_built):
    assert refused("--max-mamba-cache-size", max_mamba_cache_size=200_000_000) == (
        "the recurrent state pool needs 908.2 GB for 200000000 slots (--max-mamba-cache-size) and "
        "the cpu has 8.0 GB available (the pools may use 90% of it): lower --max-mamba-cache-size")


@pytest.mark.parametrize("kw, flag", [
    (dict(max_mamba_cache_size=10**12), "--max-mamba-cache-size"),
    (dict(max_total_tokens=10**15), "--max-total-tokens"),
    (dict(swa_full_tokens_ratio=1e300), "--swa-full-tokens-ratio"),
    (dict(enable_hierarchical_cache=True, hicache_ratio=1e300), "--hicache-ratio"),
    (dict(enable_hierarchical_cache=True, hicache_size=1e300), "--hicache-size"),
])
def test_sizes_past_int32_handles_are_refused_before_any_arithmetic_overflows(kw, flag, nothing_built):
    assert "one pool can index" in refused(flag, **kw)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), float("-inf"), 0.0, -0.5, True, "1"])
def test_swa_full_tokens_ratio_must_be_finite_and_positive(value, nothing_built):
    assert refused("--swa-full-tokens-ratio", swa_full_tokens_ratio=value) == (
        f"--swa-full-tokens-ratio must be a finite number > 0, got {value!r}")


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1.0, 0.5, 0, -2, True])
def test_hicache_ratio_must_be_finite_and_above_one(value, nothing_built):
    assert refused("--hicache-ratio", enable_hierarchical_cache=True, hicache_ratio=value).startswith(
        "--hicache-ratio must be a finite number > 1")


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0, -1.0, True])
def test_hicache_size_must_be_finite_and_positive(value, nothing_built):
    assert refused("--hicache-size", enable_hierarchical_cache=True, hicache_size=value).startswith(
        "--hicache-size must be a finite number > 0")


@pytest.mark.parametrize("flag, name", [("--page-size", "page_size"), ("--max-total-tokens", "max_total_tokens"),
                                        ("--max-mamba-cache-size", "max_mamba_cache_size")])
@pytest.mark.parametrize("value", [0, -4, 4096.0, 1.5, True, "64", None])
def test_counts_must_be_positive_ints(flag, name, value, nothing_built):
    if value is None and name == "max_mamba_cache_size":
        return  # None is its documented default: see the next test
    assert refused(flag, **{name: value}) == f"{flag} must be a positive integer, got {value!r}"


def test_the_recurrent_pool_defaults_to_four_slots_per_running_request_and_64():
    _, pools = build_cache(TINY, max_total_tokens=64, max_mamba_cache_size=None, max_running=5)
    assert pools["mamba"].size == 4 * 5 + 64


def test_fewer_tokens_than_a_page(nothing_built):
    refused("--max-total-tokens", page_size=16, max_total_tokens=8)


def test_the_engine_refuses_before_building(nothing_built):
    with pytest.raises(ValueError, match="lower --max-mamba-cache-size"):
        Engine("tiny-hybrid", max_mamba_cache_size=200_000_000)


def test_cuda_pools_are_checked_against_that_device(monkeypatch, nothing_built):
    """Device pools against the GPU's free memory; host mirrors against the host's."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (1 * GB, 80 * GB))
    msg = refused("--max-total-tokens", device="cuda", max_total_tokens=4_000_000)
    assert msg.startswith("the FULL KV pool needs 1.9 GB for 4000000 pages (--max-total-tokens) "
                          "and the cuda:0 has 1.0 GB available")
    msg = refused("--hicache-ratio", device="cuda", enable_hierarchical_cache=True, hicache_ratio=5e4)
    assert msg.startswith("the host copy of the FULL KV pool needs") and "the cpu has 8.0 GB" in msg


@pytest.mark.parametrize("hierarchical", [False, True])
def test_sizes_that_fit_still_build_and_cost_what_was_priced(hierarchical):
    cache, pools = build_cache(TINY, page_size=4, max_total_tokens=4096, swa_full_tokens_ratio=0.5,
                               max_mamba_cache_size=16, enable_hierarchical_cache=hierarchical, hicache_ratio=2.0)
    # the budget, 1,024 pages in each of the 3 KV layers (2 FULL, 1 SWA, one shape), split
    # 2:1 within it (SGLang's meaning): 1,229 x 2 + 614 = 3,072 pages
    assert {name: p.size for name, p in pools.items()} == {"full": 1229, "swa": 614, "mamba": 16}
    for p in [*pools.values(), *(cache.host_pools or [])]:
        assert sum(t.untyped_storage().nbytes() for t in p.handle_tensors()) == p.nbytes
    if hierarchical:
        assert sorted(hp.size for hp in cache.host_pools) == [32, 1228, 2458]


def test_numpy_ints_and_floats_are_fine():
    import numpy as np
    _, pools = build_cache(TINY, page_size=np.int64(2), max_total_tokens=np.int32(64),
                           swa_full_tokens_ratio=np.float64(0.5), max_mamba_cache_size=np.int64(4))
    assert pools["full"].size == 38 and pools["swa"].size == 19 and pools["mamba"].size == 4  # 38 x 2 + 19 <= 96
