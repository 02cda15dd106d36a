"""Sizes are priced before anything is allocated: a pool class's cost per handle comes
from the rows its constructor allocates (one formula), a plan builds exactly the pool
it priced, and check_fits refuses pools that do not fit the memory where they live,
naming the flags that size them, without building anything."""
import pytest
import torch

from uniradix.memory import (HandleAllocator, KVPool, MambaStatePool, PoolPlan, SidecarPool,
                             check_fits, host_sizes)
from uniradix.memory import budget

GB = 2**30
KV_SHAPE = dict(page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
MAMBA_SHAPE = dict(conv_shape=(6, 3), state_shape=(2, 3, 4), dtype=torch.bfloat16,
                   state_dtype=torch.float32)


@pytest.fixture
def host_memory(monkeypatch):
    """The host has `host_memory.bytes` available (default 8 GB), whatever this machine has."""
    class Host:
        bytes = 8 * GB
    monkeypatch.setattr(budget, "host_available_bytes", lambda *a: Host.bytes)
    return Host


@pytest.fixture
def nothing_built(monkeypatch):
    """Any pool or allocator construction fails the test: the checks run before them."""
    def built(self, *a, **kw):
        raise AssertionError(f"{type(self).__name__} was constructed")
    for cls in (KVPool, MambaStatePool, HandleAllocator):
        monkeypatch.setattr(cls, "__init__", built)


def storage_bytes(pool) -> int:
    return sum(t.untyped_storage().nbytes() for t in pool.handle_tensors())


@pytest.mark.parametrize("cls, shape, size", [(KVPool, KV_SHAPE, 12), (MambaStatePool, MAMBA_SHAPE, 6)])
def test_the_price_per_handle_is_what_the_constructor_allocates(cls, shape, size):
    per = cls.bytes_per_handle_for(3, **shape)
    pool = cls([0, 2, 5], size, **shape)
    assert pool.bytes_per_handle == per
    assert storage_bytes(pool) == pool.nbytes == size * per


def test_known_prices():
    assert KVPool.bytes_per_handle_for(3, **KV_SHAPE) == 3 * 2 * (4 * 2 * 8) * 2
    assert MambaStatePool.bytes_per_handle_for(3, **MAMBA_SHAPE) == 3 * (6 * 3 * 2 + 2 * 3 * 4 * 4)


@pytest.mark.parametrize("accounting_only", [False, True])
def test_a_plan_builds_the_pool_it_priced(accounting_only):
    plan = PoolPlan("mamba", MambaStatePool, (1, 3), 5, MAMBA_SHAPE, accounting_only=accounting_only)
    pool = plan.build()
    assert isinstance(pool, MambaStatePool) and pool.name == "mamba" and pool.size == 5
    assert pool.layer_ids == (1, 3) and pool.accounting_only == accounting_only
    assert pool.nbytes == plan.nbytes and pool.bytes_per_handle == plan.bytes_per_handle
    if not accounting_only:
        assert storage_bytes(pool) == plan.nbytes


def test_a_plan_prices_and_registers_its_sidecars():
    plan = PoolPlan("full", KVPool, (0, 1), 6, KV_SHAPE, sidecars=(SidecarPool("scale", (2,), torch.float16),))
    assert plan.bytes_per_handle == KVPool.bytes_per_handle_for(2, **KV_SHAPE) + 4
    host = plan.host_copy(12, ("--hicache-ratio",))
    assert host.bytes_per_handle == plan.bytes_per_handle and host.sidecars[0] is not plan.sidecars[0]
    for p in (plan, host):
        pool = p.build()
        assert list(pool.sidecars) == ["scale"] and pool.nbytes == p.nbytes
        assert storage_bytes(pool) + pool.sidecars["scale"].tensor.untyped_storage().nbytes() == p.nbytes


def test_what_a_plan_takes_where():
    kv = PoolPlan("full", KVPool, (0,), 10, KV_SHAPE, torch.device("meta"))
    per = KVPool.bytes_per_handle_for(1, **KV_SHAPE)
    book = 10 * HandleAllocator.BYTES_PER_HANDLE  # the allocator's arrays live on the host
    assert kv.bytes_on() == {torch.device("meta"): 10 * per, torch.device("cpu"): book}
    counting = PoolPlan("full", KVPool, (0,), 10, KV_SHAPE, accounting_only=True)
    assert counting.bytes_on() == {torch.device("cpu"): book}
    host = kv.host_copy(30, ("--hicache-ratio",))
    assert host.bytes_on() == {torch.device("cpu"): 30 * (per + HandleAllocator.BYTES_PER_HANDLE)}
    assert host.what == "the host copy of a pool" and host.flags == ("--hicache-ratio",)


def test_a_pool_that_does_not_fit_names_its_flag_and_the_figures(host_memory, nothing_built):
    per_slot = MambaStatePool.bytes_per_handle_for(2, **MAMBA_SHAPE) + HandleAllocator.BYTES_PER_HANDLE
    n = int(10 * GB / per_slot)
    plan = PoolPlan("mamba", MambaStatePool, (1, 3), n, MAMBA_SHAPE, what="the recurrent state pool",
                    unit="slots", flags=("--max-mamba-cache-size",))
    with pytest.raises(ValueError) as e:
        check_fits([plan])
    assert str(e.value) == (f"the recurrent state pool needs 10.0 GB for {n} slots (--max-mamba-cache-size) "
                            "and the cpu has 8.0 GB available (the pools may use 90% of it): "
                            "lower --max-mamba-cache-size")


def test_pools_that_fit_alone_but_not_together_are_listed(host_memory):
    per_page = KVPool.bytes_per_handle_for(1, **KV_SHAPE) + HandleAllocator.BYTES_PER_HANDLE
    full = PoolPlan("full", KVPool, (0,), int(4 * GB / per_page), KV_SHAPE, what="the FULL KV pool",
                    unit="pages", flags=("--max-total-tokens",))
    swa = PoolPlan("swa", KVPool, (1,), int(3.5 * GB / per_page), KV_SHAPE, what="the SWA KV pool",
                   unit="pages", flags=("--swa-full-tokens-ratio", "--max-total-tokens"))
    check_fits([full])
    check_fits([swa])
    with pytest.raises(ValueError) as e:
        check_fits([swa, full])
    msg = str(e.value)
    assert msg.startswith("the pools on the cpu need 7.5 GB in all (the FULL KV pool 4.0 GB")
    assert "the SWA KV pool 3.5 GB" in msg and msg.endswith("lower --max-total-tokens")


def test_the_margin(host_memory):
    per = KVPool.bytes_per_handle_for(1, **KV_SHAPE) + HandleAllocator.BYTES_PER_HANDLE
    host_memory.bytes = 1000 * per
    check_fits([PoolPlan("full", KVPool, (0,), 900, KV_SHAPE)])  # 90% of what is available
    with pytest.raises(ValueError, match="may use 90%"):
        check_fits([PoolPlan("full", KVPool, (0,), 901, KV_SHAPE)])
    check_fits([PoolPlan("full", KVPool, (0,), 1000, KV_SHAPE)], usable=1.0)


def test_device_memory_is_asked_of_that_device(monkeypatch, host_memory):
    """On CUDA the pools' tensors count against that device's free memory, their
    allocators (and host mirrors) against the host's."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: asked.append(d) or (2 * GB, 80 * GB))
    per = KVPool.bytes_per_handle_for(1, **KV_SHAPE)
    plan = PoolPlan("full", KVPool, (0,), int(3 * GB / per), KV_SHAPE, torch.device("cuda"),
                    what="the FULL KV pool", unit="pages", flags=("--max-total-tokens",))
    with pytest.raises(ValueError, match=r"needs 3.0 GB .* the cuda:1 has 2.0 GB available") as e:
        check_fits([plan])
    assert asked == [torch.device("cuda", 1)] and "cpu" not in str(e.value)
    host_memory.bytes = plan.size * HandleAllocator.BYTES_PER_HANDLE  # the bookkeeping alone overflows
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (80 * GB, 80 * GB))
    with pytest.raises(ValueError, match="the FULL KV pool's handle bookkeeping needs .* the cpu has"):
        check_fits([plan])


def test_unknown_memory_is_not_checked(monkeypatch):
    monkeypatch.setattr(budget, "host_available_bytes", lambda *a: None)
    check_fits([PoolPlan("full", KVPool, (0,), 2**31 - 1, KV_SHAPE)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert budget.available_bytes("cuda") is None and budget.available_bytes("meta") is None


def test_host_memory_is_memavailable_else_sysconf(tmp_path, monkeypatch):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       32000000 kB\nMemFree:          100000 kB\n"
                    "MemAvailable:   21000000 kB\n")
    assert budget.host_available_bytes(str(info)) == 21000000 * 1024
    sysconf = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(budget.os, "sysconf", sysconf.__getitem__)
    assert budget.host_available_bytes(str(tmp_path / "missing")) == 4096000
    info.write_text("MemTotal:       32000000 kB\n")  # an old kernel: no MemAvailable
    assert budget.host_available_bytes(str(info)) == 4096000
    def unknown(name):
        raise ValueError(f"unrecognized configuration name {name}")  # as os.sysconf says it
    monkeypatch.setattr(budget.os, "sysconf", unknown)
    assert budget.host_available_bytes(str(info)) is None


def test_this_machine_reports_its_memory():
    assert budget.available_bytes("cpu") > 0


@pytest.mark.parametrize("n", [2**31, 1e12, float("inf"), float("nan")])
def test_more_handles_than_int32_is_refused_before_anything(n, nothing_built):
    with pytest.raises(ValueError, match=r"more than the 2147483647 one pool can index \(--max-total-tokens\)"):
        PoolPlan("full", KVPool, (0,), n, KV_SHAPE, flags=("--max-total-tokens",))


def test_host_sizes_of_plans_match_those_of_pools():
    plans = {"full": PoolPlan("full", KVPool, (0, 2), 10, KV_SHAPE),
             "mamba": PoolPlan("mamba", MambaStatePool, (1,), 4, MAMBA_SHAPE)}
    pools = {name: plan.build() for name, plan in plans.items()}
    for kw in (dict(ratio=3), dict(ratio=1.1), dict(size_gb=4 * sum(p.nbytes for p in pools.values()) / GB)):
        assert host_sizes(plans, **kw) == host_sizes(pools, **kw)


@pytest.mark.parametrize("kw, flag", [(dict(ratio=1e300), "--hicache-ratio"),
                                      (dict(ratio=1e12), "--hicache-ratio"),
                                      (dict(size_gb=1e300), "--hicache-size"),
                                      (dict(size_gb=1e12), "--hicache-size")])
def test_host_sizes_past_int32_name_the_flag(kw, flag):
    """A ratio of 1e300 once made an OverflowError (int of inf) instead of a message."""
    pools = {"full": PoolPlan("full", KVPool, (0,), 1000, KV_SHAPE, what="the FULL KV pool", unit="pages")}
    with pytest.raises(ValueError, match=f"the host copy of the FULL KV pool would hold .* pages.*lower {flag}"):
        host_sizes(pools, **kw)


@pytest.mark.parametrize("kw", [dict(ratio=True), dict(size_gb=True), dict(size_gb=float("nan"))])
def test_host_sizes_refuse_bools_and_nan(kw):
    with pytest.raises(ValueError, match="--hicache-"):
        host_sizes({"full": PoolPlan("full", KVPool, (0,), 10, KV_SHAPE)}, **kw)


def test_the_allocator_still_hands_out_low_handles_first():
    """Its free stack is now filled from numpy, in the order the Python range gave."""
    a = HandleAllocator(5)
    assert sorted(a.alloc(2)) == [0, 1] and sorted(a.alloc(3)) == [2, 3, 4]
    a.check()
