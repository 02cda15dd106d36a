import pytest
import torch

from uniradix.memory import KVPool, MambaStatePool, SidecarPool


def kv(**kw):
    return KVPool([0], num_pages=8, page_size=2, num_kv_heads=1, head_dim=4, **kw)


def test_sidecar_sized_to_owner_and_listed_by_name():
    p = kv()
    sc = p.register_sidecar(SidecarPool("scale", (2, 3), torch.float16))
    assert sc.tensor.shape == (8, 2, 3) and sc.tensor.dtype == torch.float16
    assert sc.owner is p and sc.num_handles == 8
    assert dict(p.sidecars) == {"scale": sc}
    with pytest.raises(TypeError):
        p.sidecars["x"] = sc  # read-only view


def test_sidecar_rows_zeroed_on_alloc():
    p = kv()
    sc = p.register_sidecar(SidecarPool("hash", (), torch.int64))
    h = p.alloc(8)
    sc.tensor[:] = 42
    p.free(h[2:5])
    again = p.alloc(3)
    assert sorted(again) == sorted(h[2:5])
    assert torch.all(sc.tensor[list(again)] == 0)
    keep = [x for x in range(8) if x not in again]
    assert torch.all(sc.tensor[keep] == 42)


def test_sidecar_on_other_device_from_pool_still_zeroed():
    p = MambaStatePool([0], 4, (2,), (2,))
    sc = p.register_sidecar(SidecarPool("meta", (3,), torch.int32, device="cpu"))
    sc.tensor[:] = 5
    h = p.alloc(2)
    assert torch.all(sc.tensor[list(h)] == 0)


def test_sidecar_cannot_be_registered_twice_or_name_reused():
    p, q = kv(), kv()
    sc = p.register_sidecar(SidecarPool("a"))
    with pytest.raises(ValueError):
        q.register_sidecar(sc)
    with pytest.raises(ValueError):
        p.register_sidecar(SidecarPool("a"))
    with pytest.raises(TypeError):
        p.register_sidecar("a")


def test_unregistered_sidecar_has_no_tensor():
    sc = SidecarPool("x", (2,))
    with pytest.raises(RuntimeError, match="not registered"):
        sc.tensor
    assert sc.nbytes == 0 and sc.bytes_per_handle == 8


@pytest.mark.parametrize("shape", [(0,), (2, -1)])
def test_bad_sidecar_shape(shape):
    with pytest.raises(ValueError):
        SidecarPool("bad", shape)


def test_pool_nbytes_includes_sidecars():
    p = kv(dtype=torch.float32)
    base = p.nbytes
    p.register_sidecar(SidecarPool("s", (4,), torch.float32))
    assert p.nbytes == base + 8 * 16
