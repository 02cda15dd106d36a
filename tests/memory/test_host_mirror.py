"""The host tier's pools: a mirror has the device pool's layout on the CPU, every
handle's data (pool rows and sidecar rows) goes device -> host -> device bit-exact, whole
or layer by layer, and the host sizes follow --hicache-ratio / --hicache-size."""
import pytest
import torch

from uniradix.memory import (
    KVPool,
    MambaStatePool,
    SidecarPool,
    copy_handles,
    host_mirror,
    host_sizes,
)
from uniradix.memory import rows as row_copy


@pytest.fixture(params=["c", "torch"])
def copy_path(request, monkeypatch):
    """Each copy test twice: through memory/rows.c (counted, so a test that never reached
    it fails) and through torch's gather and scatter."""
    calls = []
    if request.param == "c":
        assert row_copy.available()
        fn = row_copy._state["fn"]
        monkeypatch.setitem(row_copy._state, "fn", lambda *a: (calls.append(a), fn(*a)))
    else:
        monkeypatch.setattr(row_copy, "_state", {"tried": True, "fn": None})
    yield request.param
    if request.param == "c":
        assert calls, "the C row copy was never called"


def kv_pool(dtype=torch.float32, size=10, **kw):
    return KVPool([0, 2, 4], size, 2, 2, 4, dtype, name="full", **kw)


def mamba_pool(dtype=torch.float32, size=8, **kw):
    return MambaStatePool([1, 3], size, (3, 2), (2, 2, 4), dtype, state_dtype=torch.float32,
                          name="mamba", **kw)


def mamba_of_two_shapes(dtype=torch.float32, size=8, **kw):
    """Layers of different shapes: each shape's layers share buffers of their own, so a
    layer's place in its buffer is not its place among the pool's layers."""
    a = ((3, 2), (2, 2, 4), dtype, torch.float32)
    b = ((5, 3), (4, 6), torch.float32, dtype)
    return MambaStatePool([1, 3, 5], size, layer_shapes={1: a, 3: b, 5: a}, name="mamba", **kw)


MAKERS = {"kv": kv_pool, "mamba": mamba_pool}


def with_sidecars(pool):
    pool.register_sidecar(SidecarPool("scale", (2,), torch.float16))
    pool.register_sidecar(SidecarPool("pos", (), torch.int64))
    return pool


def fill(pool, seed):
    """Random contents everywhere, so a missed or misplaced row shows."""
    g = torch.Generator().manual_seed(seed)
    for t in pool.handle_tensors() + [sc.tensor for sc in pool.sidecars.values()]:
        if t.dtype.is_floating_point:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        else:
            t.copy_(torch.randint(-10**9, 10**9, t.shape, generator=g))


def tensors(pool):
    return pool.handle_tensors() + [sc.tensor for sc in pool.sidecars.values()]


def snapshot(pool):
    return [t.clone() for t in tensors(pool)]


def rows(pool, handles):
    """What each handle holds, on the CPU: [:, h] of the pool's tensors, [h] of the sidecars'."""
    parts = [(t, 1) for t in pool.handle_tensors()] + [(sc.tensor, 0) for sc in pool.sidecars.values()]
    return [t.index_select(dim, torch.as_tensor(list(handles), dtype=torch.long, device=t.device)).cpu()
            for t, dim in parts]


def same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", MAKERS)
def test_mirror_has_the_layout_on_the_cpu(kind):
    src = with_sidecars(MAKERS[kind](torch.bfloat16))
    m = host_mirror(src, 23)
    assert type(m) is type(src) and m.name == src.name and m.layer_ids == src.layer_ids
    assert m.size == 23 and m.available == 23 and m.device == torch.device("cpu")
    assert not m.accounting_only and m.bytes_per_handle == src.bytes_per_handle
    for a, b in zip(m.handle_tensors(), src.handle_tensors(), strict=True):
        assert a.shape == (b.shape[0], 23, *b.shape[2:]) and a.dtype == b.dtype
        assert a.device.type == "cpu"
    assert list(m.sidecars) == ["scale", "pos"]
    for name, sc in m.sidecars.items():
        ref = src.sidecars[name]
        assert sc is not ref and sc.owner is m
        assert sc.shape_per_handle == ref.shape_per_handle and sc.dtype == ref.dtype
        assert sc.tensor.shape == (23, *ref.shape_per_handle) and sc.device.type == "cpu"
    # the source is untouched
    assert src.size == MAKERS[kind]().size and list(src.sidecars) == ["scale", "pos"]
    assert all(s.owner is src for s in src.sidecars.values())


@pytest.mark.parametrize("kind", MAKERS)
def test_a_cpu_pool_mirror_is_not_pinned(kind):
    m = host_mirror(with_sidecars(MAKERS[kind]()), 12)
    assert m.pin_memory is False
    assert not any(t.is_pinned() for t in tensors(m))
    assert all(sc.pin_memory is False for sc in m.sidecars.values())


def test_pinning_is_for_host_memory_only():
    with pytest.raises(ValueError, match="pin_memory"):
        KVPool([0], 4, 2, 1, 4, device="meta", pin_memory=True)
    with pytest.raises(ValueError, match="pin_memory"):
        SidecarPool("x", (2,), device="meta", pin_memory=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_pool_mirror_is_pinned():
    m = host_mirror(with_sidecars(kv_pool(device="cuda")), 12)
    assert m.pin_memory and all(t.is_pinned() and t.device.type == "cpu" for t in tensors(m))


def test_an_accounting_only_pool_gets_an_accounting_only_mirror():
    big = KVPool(range(64), 2_000_000, 64, 8, 128, torch.float32, accounting_only=True, name="f")
    big.register_sidecar(SidecarPool("scale", (8,)))
    m = host_mirror(big, 4_000_000)
    assert m.accounting_only and m.size == 4_000_000 and m.sidecars["scale"].accounting_only
    assert m.nbytes == 2 * big.nbytes
    h = m.alloc(3)
    copy_handles(big, big.alloc(3), m, h)  # nothing to copy: a no-op
    for lid in big.layer_ids:
        copy_handles(m, h, big, big.alloc(3), layer_id=lid)
    with pytest.raises(ValueError, match="3 source handles but 2"):
        copy_handles(big, big.alloc(3), m, m.alloc(2))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", MAKERS)
def test_device_to_host_to_fresh_device_handles_is_bit_exact(kind, dtype, device, copy_path):
    dev = with_sidecars(MAKERS[kind](dtype, device=device))
    fill(dev, 0)
    held = dev.alloc(4)
    host = host_mirror(dev, 2 * dev.size)
    fill(host, 1)
    host.alloc(3)  # so host handles differ from device handles
    hh = host.alloc(4)
    hh = hh[::-1]  # and not in the same order
    before = snapshot(host)
    copy_handles(dev, held, host, hh)
    assert same(rows(host, hh), rows(dev, held))
    others = [h for h in range(host.size) if h not in hh]
    assert same(rows(host, others), [t.index_select(1 if i < len(host.handle_tensors()) else 0,
                                                    torch.tensor(others)) for i, t in enumerate(before)])
    fresh = dev.alloc(4)
    assert not same(rows(dev, fresh), rows(dev, held))  # alloc zeroed their sidecar rows at least
    copy_handles(host, hh, dev, fresh, non_blocking=True)
    if device == "cuda":
        torch.cuda.synchronize()
    assert same(rows(dev, fresh), rows(dev, held))
    # bit-exact, not merely equal: compare the raw bytes too
    for a, b in zip(rows(dev, fresh), rows(dev, held)):
        assert a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("kind", MAKERS)
def test_layer_by_layer_equals_one_whole_copy_and_moves_sidecars_once(kind, copy_path):
    src = with_sidecars(MAKERS[kind](torch.bfloat16))
    fill(src, 0)
    a, b = host_mirror(src, 9), host_mirror(src, 9)
    fill(a, 1)
    fill(b, 1)
    sh = src.alloc(3)
    ha, hb = a.alloc(3), b.alloc(3)
    copy_handles(src, sh, a, ha)
    first, *rest = src.layer_ids
    copy_handles(src, sh, b, hb, layer_id=first)
    # the first layer brought the sidecars; later layers are not there yet
    n_own = len(src.handle_tensors())
    assert same(rows(b, hb)[n_own:], rows(src, sh)[n_own:])
    got, want = rows(b, hb)[:n_own], rows(src, sh)[:n_own]  # each [layers, 3, ...]
    assert all(torch.equal(x[0], y[0]) for x, y in zip(got, want))
    assert not any(torch.equal(x[1], y[1]) for x, y in zip(got, want))
    # a sidecar changed at the source now must not travel again with the later layers
    for sc in src.sidecars.values():
        sc.tensor[list(sh)] = 7
    for lid in rest:
        copy_handles(src, sh, b, hb, layer_id=lid)
    assert same(rows(b, hb)[:n_own], rows(src, sh)[:n_own])
    assert same(snapshot(b), snapshot(a))


@pytest.mark.parametrize("kind", [*MAKERS, "mamba of two shapes"])
def test_a_layer_copy_writes_that_layers_rows_and_nothing_else(kind, copy_path):
    """Layer by layer, each run writes exactly the layer's rows of the handles asked for,
    wherever the pool keeps that layer; every other byte of the destination stays."""
    make = MAKERS.get(kind, mamba_of_two_shapes)
    src = make(torch.bfloat16)
    fill(src, 0)
    dst = host_mirror(src, 9)
    fill(dst, 1)
    sh, hh = src.alloc(3), dst.alloc(5)[1:4]
    idx_s, idx_d = torch.tensor(list(sh)), torch.tensor(list(hh))
    before = {lid: [t.clone() for t in dst.layer_tensors(lid)] for lid in src.layer_ids}
    for n, lid in enumerate(src.layer_ids):
        copy_handles(src, sh, dst, hh, layer_id=lid)
        for k, other in enumerate(src.layer_ids):
            for s, d, old in zip(src.layer_tensors(other), dst.layer_tensors(other), before[other]):
                want = old.clone()
                if k <= n:  # copied by now
                    want[idx_d] = s[idx_s]
                assert torch.equal(d, want), (lid, other)


def test_mismatched_pools_and_handles_are_refused():
    src = with_sidecars(kv_pool())
    h = src.alloc(2)

    def other(pool, handles=None):
        return lambda: copy_handles(src, h, pool, pool.alloc(2) if handles is None else handles)

    cases = [
        (other(KVPool([0, 2, 4], 8, 4, 2, 4, name="full")), "shapes"),           # page size
        (other(with_sidecars(kv_pool(torch.bfloat16))), "dtypes"),
        (other(KVPool([0, 2], 8, 2, 2, 4)), "layer ids"),
        (other(kv_pool()), "sidecars"),                                           # none registered
        (other(KVPool([0, 2, 4], 8, 2, 2, 4, accounting_only=True)), "accounting-only"),
    ]
    odd = kv_pool()
    odd.register_sidecar(SidecarPool("scale", (2,), torch.float32))
    odd.register_sidecar(SidecarPool("pos", (), torch.int64))
    cases.append((other(odd), "sidecars"))
    dst = with_sidecars(kv_pool())
    cases += [
        (other(dst, dst.alloc(3)), "2 source handles but 3"),
        (other(dst, [5, 5]), "not allocated"),
        (other(dst, [0, 99]), "out of range"),
    ]
    two = dst.alloc(2)
    cases.append((lambda: copy_handles(src, h, dst, [two[0], two[0]]), "more than once"))
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()
    with pytest.raises(KeyError):
        copy_handles(src, h, dst, two, layer_id=1)
    with pytest.raises(TypeError):
        copy_handles(src, h, "dst", two)


def test_host_sizes_follow_the_ratio():
    pools = {"full": kv_pool(size=10), "mamba": mamba_pool(size=4),
             "count": KVPool([0], 7, 2, 1, 4, accounting_only=True)}
    assert host_sizes(pools) == {"full": 20, "mamba": 8, "count": 14}
    assert host_sizes(pools, ratio=3) == {"full": 30, "mamba": 12, "count": 21}
    # always at least one more than the device: int(4 * 1.1) would be 4
    assert host_sizes(pools, ratio=1.1) == {"full": 11, "mamba": 5, "count": 8}


def test_host_size_in_gb_overrides_the_ratio():
    pools = {"full": kv_pool(size=10), "mamba": mamba_pool(size=4),
             "count": KVPool([0], 7, 2, 1, 4, accounting_only=True)}
    device = pools["full"].nbytes + pools["mamba"].nbytes  # accounting-only counts nothing
    gb = 3 * device / 2**30
    assert host_sizes(pools, ratio=1.5, size_gb=gb) == {"full": 30, "mamba": 12, "count": 21}
    with pytest.raises(ValueError, match="--hicache-size") as e:
        host_sizes(pools, size_gb=device / 2**30)
    assert str(device) in str(e.value)
    with pytest.raises(ValueError, match="--hicache-size") as e:
        host_sizes(pools, size_gb=0.5 * device / 2**30)
    assert str(device // 2) in str(e.value) and str(device) in str(e.value)
    with pytest.raises(ValueError, match="--hicache-size"):
        host_sizes(pools, size_gb=0)
    with pytest.raises(ValueError, match="--hicache-size"):
        host_sizes({"count": pools["count"]}, size_gb=1)


@pytest.mark.parametrize("ratio", [1, 1.0, 0.5, 0, -2, float("nan")])
def test_host_ratio_must_exceed_one(ratio):
    with pytest.raises(ValueError, match=r"--hicache-ratio must be greater than 1"):
        host_sizes({"full": kv_pool()}, ratio=ratio)
