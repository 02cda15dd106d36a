from array import array

import numpy as np
import pytest
import torch

from uniradix.memory import DoubleFree, HandleAllocator, PoolExhausted


def snapshot(a: HandleAllocator):
    return a.available, a.used, list(a.allocated())


def test_fresh_allocator_is_all_free():
    a = HandleAllocator(10, "pages")
    assert (a.size, a.available, a.used) == (10, 10, 0)
    assert list(a.allocated()) == []
    assert not any(a.is_allocated(h) for h in range(10))
    a.check()


def test_alloc_returns_distinct_int32_handles_in_range():
    a = HandleAllocator(16)
    h1, h2 = a.alloc(5), a.alloc(11)
    assert isinstance(h1, array) and h1.typecode == "i"
    both = list(h1) + list(h2)
    assert sorted(both) == list(range(16))
    assert a.available == 0 and a.used == 16
    assert list(a.allocated()) == list(range(16))
    assert all(a.is_allocated(h) for h in range(16))
    a.check()


def test_alloc_zero_is_empty_and_takes_nothing():
    a = HandleAllocator(4)
    h = a.alloc(0)
    assert isinstance(h, array) and h.typecode == "i" and len(h) == 0
    assert a.available == 4
    a.free(h)
    assert a.available == 4


def test_round_trip_returns_everything():
    a = HandleAllocator(8)
    h = a.alloc(8)
    a.free(h)
    assert a.available == 8 and a.used == 0 and list(a.allocated()) == []
    again = a.alloc(8)
    assert sorted(again) == list(range(8))
    a.check()


def test_freed_handles_are_reused_first():
    a = HandleAllocator(100)
    a.alloc(10)
    h = a.alloc(3)
    a.free(h)
    assert sorted(a.alloc(3)) == sorted(h)


def test_returned_arrays_are_independent_and_resizable():
    a = HandleAllocator(8)
    h = a.alloc(3)
    h.append(99)  # would raise BufferError if the allocator kept a view
    h[0] = 7
    del h[:]
    assert a.used == 3
    a.check()


def test_exhaustion_raises_and_takes_nothing():
    a = HandleAllocator(6, "swa_pages")
    a.alloc(4)
    before = snapshot(a)
    with pytest.raises(PoolExhausted) as exc:
        a.alloc(3)
    msg = str(exc.value)
    assert "swa_pages" in msg and "3" in msg and "2" in msg
    assert snapshot(a) == before
    assert len(a.alloc(2)) == 2
    with pytest.raises(PoolExhausted):
        a.alloc(1)
    a.check()


def test_pool_exhausted_is_runtime_error_and_double_free_value_error():
    assert issubclass(PoolExhausted, RuntimeError)
    assert issubclass(DoubleFree, ValueError)


def test_negative_and_non_int_counts_rejected():
    a = HandleAllocator(4)
    with pytest.raises(ValueError):
        a.alloc(-1)
    with pytest.raises(TypeError):
        a.alloc(1.5)
    assert a.alloc(np.int64(2)).tolist() != []
    assert a.available == 2


@pytest.mark.parametrize("size", [0, -3])
def test_non_positive_size_rejected(size):
    with pytest.raises(ValueError):
        HandleAllocator(size)


def test_double_free_raises_and_frees_nothing():
    a = HandleAllocator(10)
    h = a.alloc(6)
    a.free(h[:2])
    before = snapshot(a)
    with pytest.raises(DoubleFree, match="not allocated"):
        a.free(array("i", [h[3], h[0]]))  # h[0] already freed
    assert snapshot(a) == before
    assert a.is_allocated(h[3])
    a.check()


def test_free_of_never_allocated_handle():
    a = HandleAllocator(10)
    h = a.alloc(3)
    never = next(x for x in range(10) if x not in h)
    before = snapshot(a)
    with pytest.raises(DoubleFree):
        a.free([h[0], never])
    assert snapshot(a) == before


@pytest.mark.parametrize("bad", [-1, 10, 2**31 - 1, -(2**31)])
def test_free_out_of_range_frees_nothing(bad):
    a = HandleAllocator(10)
    h = a.alloc(10)
    with pytest.raises(DoubleFree, match="out of range"):
        a.free(array("i", [h[0], bad]))
    assert a.used == 10
    a.check()


def test_free_value_beyond_int32_is_out_of_range_not_wrapped():
    a = HandleAllocator(10)
    a.alloc(10)
    with pytest.raises(DoubleFree):
        a.free(np.array([2**32 + 3], dtype=np.int64))  # would wrap to 3
    assert a.used == 10


def test_duplicate_within_one_call_frees_nothing():
    a = HandleAllocator(10)
    h = a.alloc(5)
    before = snapshot(a)
    with pytest.raises(DoubleFree, match="more than once"):
        a.free(array("i", [h[1], h[2], h[1]]))
    assert snapshot(a) == before
    assert all(a.is_allocated(x) for x in h)
    a.free(h)  # still freeable afterwards, exactly once
    assert a.used == 0
    a.check()


def test_failed_free_does_not_pin_callers_array():
    a = HandleAllocator(4)
    h = a.alloc(2)
    bad = array("i", [h[0], h[0]])
    with pytest.raises(DoubleFree) as exc:
        a.free(bad)
    assert exc.value is not None
    bad.append(1)  # BufferError if the traceback still held a numpy view
    assert len(bad) == 3


def test_second_free_of_same_batch_raises():
    a = HandleAllocator(5)
    h = a.alloc(5)
    a.free(h)
    with pytest.raises(DoubleFree):
        a.free(h)
    assert a.available == 5
    a.check()


@pytest.mark.parametrize(
    "convert",
    [
        list,
        tuple,
        lambda h: array("i", h),
        lambda h: array("l", h),
        lambda h: np.array(h, dtype=np.int64),
        lambda h: np.array(h, dtype=np.int32),
        lambda h: np.array(h, dtype=np.uint16),
        lambda h: np.repeat(np.array(h, dtype=np.int64), 2)[::2],  # non-contiguous
        lambda h: torch.tensor(list(h), dtype=torch.int64),
        lambda h: torch.tensor(list(h), dtype=torch.int32),
    ],
    ids=["list", "tuple", "array_i", "array_l", "np_i64", "np_i32", "np_u16",
         "np_strided", "torch_i64", "torch_i32"],
)
def test_handles_accepted_in_many_forms(convert):
    a = HandleAllocator(20)
    a.alloc(4)
    h = a.alloc(6)
    a.free(convert(h))
    assert a.used == 4 and not any(a.is_allocated(x) for x in h)
    a.check()


def test_range_accepted():
    a = HandleAllocator(10)
    a.alloc(10)
    a.free(range(2, 8))
    assert list(a.allocated()) == [0, 1, 8, 9]


@pytest.mark.parametrize(
    "bad, exc",
    [
        (np.array([1.0, 2.0]), TypeError),
        (torch.tensor([True, False]), TypeError),
        (np.array([[0, 1]]), ValueError),
        (3, TypeError),
    ],
)
def test_non_integer_or_nd_handles_rejected_and_nothing_freed(bad, exc):
    a = HandleAllocator(4)
    a.alloc(4)
    with pytest.raises(exc):
        a.free(bad)
    assert a.used == 4


def test_allocated_is_sorted():
    a = HandleAllocator(50)
    a.alloc(50)
    a.free(list(range(0, 50, 3)))
    got = list(a.allocated())
    assert got == sorted(got) == [x for x in range(50) if x % 3]


def test_is_allocated_out_of_range_is_false():
    a = HandleAllocator(3)
    a.alloc(3)
    assert not a.is_allocated(-1) and not a.is_allocated(3)


def test_require_allocated():
    a = HandleAllocator(6)
    h = a.alloc(3)
    assert a.require_allocated(h).tolist() == list(h)
    free_one = next(x for x in range(6) if x not in h)
    with pytest.raises(ValueError):
        a.require_allocated([h[0], free_one])
    with pytest.raises(ValueError):
        a.require_allocated([6])
    with pytest.raises(ValueError):
        a.require_allocated([-1])


def test_check_detects_corruption():
    a = HandleAllocator(6)
    a.alloc(3)
    a.check()
    a._free[a._top] = a._free[0]  # a handle on the free list twice
    a._top += 1
    with pytest.raises(AssertionError):
        a.check()


def test_check_detects_state_free_list_disagreement():
    a = HandleAllocator(6)
    h = a.alloc(3)
    a._state[h[0]] = 1  # marked free but not on the free list
    with pytest.raises(AssertionError):
        a.check()
