import numpy as np
import pytest
import torch

from uniradix.memory import MambaStatePool, SidecarPool

LAYERS = [1, 4, 7]


def make(**kw):
    args = dict(layer_ids=LAYERS, num_slots=6, conv_shape=(3, 5), state_shape=(2, 4, 4))
    args.update(kw)
    return MambaStatePool(**args)


def fill_slot(p, slot, base):
    for i, lid in enumerate(LAYERS):
        p.conv(lid)[slot] = base + i
        p.state(lid)[slot] = base + 10 * i


def test_shapes_and_dtypes():
    p = make(dtype=torch.bfloat16, state_dtype=torch.float32)
    for lid in LAYERS:
        assert p.conv(lid).shape == (6, 3, 5) and p.conv(lid).dtype == torch.bfloat16
        assert p.state(lid).shape == (6, 2, 4, 4) and p.state(lid).dtype == torch.float32
    assert p.num_slots == 6


def test_copy_slot_copies_every_layer_and_sidecar_and_keeps_source():
    p = make()
    pos = p.register_sidecar(SidecarPool("pos", (), torch.int64))
    extra = p.register_sidecar(SidecarPool("extra", (2,), torch.float32))
    src, dst, other = p.alloc(3)
    fill_slot(p, src, 1.0)
    fill_slot(p, other, 50.0)
    pos.tensor[src] = 123
    extra.tensor[src] = torch.tensor([0.5, -0.5])
    p.copy_slot(src, dst)
    for i, lid in enumerate(LAYERS):
        assert torch.all(p.conv(lid)[dst] == 1.0 + i)
        assert torch.all(p.state(lid)[dst] == 1.0 + 10 * i)
        assert torch.all(p.conv(lid)[src] == 1.0 + i)  # source intact
        assert torch.all(p.state(lid)[src] == 1.0 + 10 * i)
        assert torch.all(p.conv(lid)[other] == 50.0 + i)  # bystander intact
    assert pos.tensor[dst] == 123 and pos.tensor[src] == 123
    assert torch.equal(extra.tensor[dst], torch.tensor([0.5, -0.5]))
    # Later writes to the copy do not reach the source.
    p.state(4)[dst] = -1
    assert torch.all(p.state(4)[src] == 11.0)


def test_copy_slots_batched_and_overlapping():
    p = make()
    sc = p.register_sidecar(SidecarPool("tag", (), torch.int32))
    a, b, c = p.alloc(3)
    fill_slot(p, a, 1.0)
    fill_slot(p, b, 2.0)
    fill_slot(p, c, 3.0)
    sc.tensor[[a, b, c]] = torch.tensor([10, 20, 30], dtype=torch.int32)
    # rotate a->b, b->c, c->a: sources must be read before destinations change
    p.copy_slots(np.array([a, b, c]), torch.tensor([b, c, a]))
    for i, lid in enumerate(LAYERS):
        assert torch.all(p.conv(lid)[b] == 1.0 + i)
        assert torch.all(p.conv(lid)[c] == 2.0 + i)
        assert torch.all(p.state(lid)[a] == 3.0 + 10 * i)
    assert sc.tensor[[a, b, c]].tolist() == [30, 10, 20]


def test_copy_requires_allocated_slots_and_matching_lengths():
    p = make()
    a, b = p.alloc(2)
    free_slot = next(s for s in range(6) if s not in (a, b))
    with pytest.raises(ValueError):
        p.copy_slot(a, free_slot)
    with pytest.raises(ValueError):
        p.copy_slot(free_slot, a)
    with pytest.raises(ValueError):
        p.copy_slots([a], [b, a])
    with pytest.raises(ValueError):
        p.copy_slots([a, a], [b, b])  # destination listed twice
    with pytest.raises(ValueError):
        p.copy_slots([a], [99])


def test_zero_slots_clears_only_those_slots():
    p = make()
    a, b = p.alloc(2)
    fill_slot(p, a, 1.0)
    fill_slot(p, b, 2.0)
    p.zero_slots([a])
    for lid in LAYERS:
        assert torch.all(p.conv(lid)[a] == 0) and torch.all(p.state(lid)[a] == 0)
        assert torch.all(p.conv(lid)[b] != 0)


def test_bytes_per_handle_and_nbytes():
    p = make(dtype=torch.bfloat16, state_dtype=torch.float32)
    per = 3 * (3 * 5 * 2 + 2 * 4 * 4 * 4)
    assert p.bytes_per_handle == per
    real = p.conv(1).untyped_storage().nbytes() + p.state(1).untyped_storage().nbytes()
    assert p.nbytes == 6 * per == real
    p.register_sidecar(SidecarPool("s", (4,), torch.float64))
    assert p.bytes_per_handle == per + 32


def test_unknown_layer_and_bad_shapes():
    p = make()
    with pytest.raises(KeyError, match="layer 2"):
        p.conv(2)
    with pytest.raises(KeyError, match="layer 0"):
        p.state(0)
    with pytest.raises(ValueError):
        make(num_slots=0)
    with pytest.raises(ValueError):
        make(conv_shape=(3, 0))
