import pytest
import torch

from uniradix.memory import DoubleFree, KVPool, MambaStatePool, PoolExhausted, SidecarPool

# Sizes whose tensors would need terabytes: constructing them proves that
# accounting-only pools allocate nothing.
HUGE_PAGES = 2_000_000


def huge_kv():
    return KVPool(range(64), HUGE_PAGES, 64, 8, 128, torch.float32, accounting_only=True)


def test_accounting_only_allocates_no_tensors():
    p = huge_kv()
    assert p.nbytes == HUGE_PAGES * 2 * 64 * 64 * 8 * 128 * 4  # ~34 TB, from shapes
    m = MambaStatePool(range(64), 1_000_000, (4, 8192), (64, 128, 128), accounting_only=True)
    assert m.nbytes > 10**13


def test_accessors_raise_clear_error():
    p = huge_kv()
    with pytest.raises(RuntimeError, match="accounting-only"):
        p.k(0)
    with pytest.raises(RuntimeError, match="accounting-only"):
        p.v(63)
    m = MambaStatePool([2], 4, (3,), (3,), accounting_only=True)
    with pytest.raises(RuntimeError, match="accounting-only"):
        m.conv(2)
    with pytest.raises(RuntimeError, match="accounting-only"):
        m.state(2)
    with pytest.raises(KeyError):
        m.conv(5)


def test_same_allocator_behaviour_as_real_pool():
    real = KVPool([0], 6, 2, 1, 4)
    fake = KVPool([0], 6, 2, 1, 4, accounting_only=True)
    for p in (real, fake):
        p.register_sidecar(SidecarPool("s", (2,)))
    log = []
    for p in (real, fake):
        h = p.alloc(4)
        p.free(h[1:3])
        h2 = p.alloc(3)
        with pytest.raises(PoolExhausted):
            p.alloc(2)
        p.free(h2[:1])
        with pytest.raises(DoubleFree):
            p.free(h2[:1])
        log.append((list(h), list(h2), p.available, list(p.allocator.allocated())))
    assert log[0] == log[1]


def test_sidecar_on_accounting_only_pool_is_accounting_only():
    p = huge_kv()
    sc = p.register_sidecar(SidecarPool("big", (1024,), torch.float64))
    assert sc.accounting_only
    assert sc.nbytes == HUGE_PAGES * 1024 * 8
    with pytest.raises(RuntimeError, match="accounting-only"):
        sc.tensor
    h = p.alloc(1000)  # no sidecar zeroing to do, but accounting still exact
    assert p.used == 1000 and len(h) == 1000


def test_mamba_copy_is_validated_noop_when_accounting_only():
    m = MambaStatePool([0, 1], 4, (3,), (3,), accounting_only=True)
    m.register_sidecar(SidecarPool("s"))
    a, b = m.alloc(2)
    m.copy_slot(a, b)
    m.copy_slots([a], [b])
    m.zero_slots([a, b])
    free_slot = next(s for s in range(4) if s not in (a, b))
    with pytest.raises(ValueError):
        m.copy_slot(a, free_slot)
    with pytest.raises(ValueError):
        m.copy_slots([free_slot], [a])
