from array import array

import numpy as np
import pytest
import torch

from uniradix.memory import DoubleFree, KVPool, PoolExhausted


def make(**kw):
    args = dict(layer_ids=[0, 3, 5], num_pages=12, page_size=4, num_kv_heads=2, head_dim=8,
                dtype=torch.float32)
    args.update(kw)
    return KVPool(**args)


def test_shapes_dtype_device():
    p = make(dtype=torch.bfloat16)
    for lid in (0, 3, 5):
        for t in (p.k(lid), p.v(lid)):
            assert t.shape == (12, 4, 2, 8)
            assert t.dtype == torch.bfloat16 and t.device.type == "cpu"
            assert t.is_contiguous()
    assert p.page_shape == (4, 2, 8)
    assert p.num_pages == p.size == 12 and p.layer_ids == (0, 3, 5)


def test_write_through_page_handle_lands_in_that_page_only():
    p = make()
    p.alloc(2)
    h = p.alloc(3)
    page = h[1]
    p.k(3)[page] = 1.5
    p.v(3)[page, 2] = -2.0
    # Same storage on the next access (a view, not a copy).
    assert torch.all(p.k(3)[page] == 1.5)
    assert torch.all(p.v(3)[page, 2] == -2.0) and torch.all(p.v(3)[page, :2] == 0)
    others = [x for x in range(12) if x != page]
    assert torch.all(p.k(3)[others] == 0) and torch.all(p.v(3)[others] == 0)
    for lid in (0, 5):
        assert torch.all(p.k(lid) == 0) and torch.all(p.v(lid) == 0)


def test_scatter_with_handle_tensor_matches_per_page_writes():
    p = make()
    h = p.alloc(5)
    vals = torch.arange(5 * 4 * 2 * 8, dtype=torch.float32).reshape(5, 4, 2, 8)
    p.k(5)[torch.as_tensor(np.frombuffer(h, dtype=np.int32)).long()] = vals
    for i, page in enumerate(h):
        assert torch.equal(p.k(5)[page], vals[i])


def test_alloc_free_accounting():
    p = make(num_pages=5)
    h = p.alloc(5)
    assert p.available == 0 and p.used == 5
    with pytest.raises(PoolExhausted):
        p.alloc(1)
    p.free(h[:2])
    assert p.available == 2
    with pytest.raises(DoubleFree):
        p.free(h[:1])
    p.free(torch.tensor(list(h[2:])))
    assert p.available == 5
    p.allocator.check()


def test_bytes_per_handle_and_nbytes_match_tensors():
    p = make(dtype=torch.float16)
    assert p.bytes_per_handle == 2 * 3 * 4 * 2 * 8 * 2
    real = sum(t.untyped_storage().nbytes() for t in (p.k(0), p.v(0)))
    assert p.nbytes == p.size * p.bytes_per_handle == real


def test_unknown_layer_is_key_error_naming_layer():
    p = make()
    with pytest.raises(KeyError, match="layer 4"):
        p.k(4)
    with pytest.raises(KeyError, match="layer 9"):
        p.v(9)


@pytest.mark.parametrize(
    "kw",
    [dict(num_pages=0), dict(page_size=0), dict(num_kv_heads=-1), dict(head_dim=0),
     dict(layer_ids=[]), dict(layer_ids=[1, 1]), dict(layer_ids=[-1])],
)
def test_bad_construction_is_value_error(kw):
    with pytest.raises(ValueError):
        make(**kw)


def test_bad_dtype_is_type_error():
    with pytest.raises(TypeError):
        make(dtype="float16")


def test_swa_pool_is_a_separate_instance():
    full = make(name="full", num_pages=20)
    swa = make(name="swa", num_pages=6, layer_ids=[1, 2])
    full.alloc(20)
    assert swa.available == 6
    with pytest.raises(PoolExhausted, match="full"):
        full.alloc(1)
    assert isinstance(swa.alloc(6), array)
