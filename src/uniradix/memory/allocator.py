"""Exact handle accounting: which integer handles (pages, slots) are free.

The radix tree moves handles around as ``array('i')``; this allocator is in
its hot path, so every check is vectorised over a numpy view of the caller's
buffer (no per-handle Python work) and the free list is an ``array('i')``
stack, so ``alloc`` is one slice and ``free`` one memcpy.

Rough cost check (should print a few microseconds per call)::

    import timeit
    from uniradix.memory import HandleAllocator
    a = HandleAllocator(100_000)
    t = timeit.timeit(lambda: a.free(a.alloc(200)), number=100_000)
    print(f"{t / 100_000 * 1e6:.2f} us per alloc(200)+free")
"""

from __future__ import annotations

from array import array
from operator import index as _as_int

import numpy as np

__all__ = ["PoolExhausted", "DoubleFree", "HandleAllocator", "as_index_array"]

_I32 = np.dtype(np.int32)
_U32 = np.dtype(np.uint32)
_I32_MIN = int(np.iinfo(np.int32).min)
_I32_MAX = int(np.iinfo(np.int32).max)
_EMPTY = np.zeros(0, dtype=np.int32)
_EMPTY.flags.writeable = False


class PoolExhausted(RuntimeError):
    """More handles were asked for than are free; nothing was taken."""


class DoubleFree(ValueError):
    """A free named a handle that is not currently allocated (never was,
    already freed, out of range, or listed twice); nothing was freed."""


class _NotInt32(ValueError):
    """A handle value that cannot be an int32 handle of any pool."""


def as_index_array(handles) -> np.ndarray:
    """Handles as a 1-D contiguous int32 numpy array.

    ``array('i')`` input comes back as a zero-copy view; lists, tuples,
    ranges, other integer arrays and integer torch tensors are converted.
    Floats, bools and multi-dimensional input are refused rather than
    silently cast, since a wrong handle corrupts someone else's cache.
    """
    if type(handles) is array:
        if handles.typecode == "i":
            return np.frombuffer(handles, dtype=_I32) if len(handles) else _EMPTY
        arr = np.asarray(handles)
    elif isinstance(handles, np.ndarray):
        arr = handles
    elif isinstance(handles, range):
        arr = np.arange(handles.start, handles.stop, handles.step, dtype=np.int64)
    elif isinstance(handles, (list, tuple)):
        if not handles:
            return _EMPTY
        arr = np.asarray(handles)
    elif isinstance(handles, (int, np.integer)):
        raise TypeError(
            f"handles must be a sequence of ints, not a single {type(handles).__name__}"
        )
    elif hasattr(handles, "detach") and hasattr(handles, "numpy"):  # torch.Tensor
        arr = handles.detach().cpu().numpy()
    else:
        arr = np.asarray(handles)
    if arr.ndim != 1:
        raise ValueError(f"handles must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype != _I32:
        if arr.dtype.kind not in "iu":
            if arr.size == 0:
                return _EMPTY
            raise TypeError(f"handles must be integers, got dtype {arr.dtype}")
        if arr.size and (int(arr.min()) < _I32_MIN or int(arr.max()) > _I32_MAX):
            raise _NotInt32(f"handle values outside int32 range: {arr.min()}..{arr.max()}")
        arr = arr.astype(_I32)
    return np.ascontiguousarray(arr)


def _preview(values, limit: int = 8) -> str:
    vals = [int(v) for v in values[:limit]]
    more = f", ... ({len(values)} total)" if len(values) > limit else ""
    return f"{vals}{more}"


class HandleAllocator:
    """Owns handles ``0..size-1``; each one is always either free or allocated.

    ``_state[h] == 0`` means allocated, non-zero means free.  A free writes
    ``1..n`` into the freed slots and reads them back: if a handle is listed
    twice, one of its positions reads the other's value, which detects
    duplicates in O(n) without sorting.  (Zero-means-allocated lets the
    "all allocated?" test be a ``count_nonzero``, the cheapest numpy check.)
    """

    __slots__ = ("_size", "_name", "_free", "_top", "_state", "_mark", "_cells")

    #: batches up to this size take a scalar path: numpy's per-call cost dominates there
    SMALL = 8
    #: the most handles one allocator can own (they are int32)
    MAX_SIZE = _I32_MAX
    #: host bytes each handle costs while the allocator is built: the free stack, the
    #: ownership state and the descending range the stack is filled from (8 once built)
    BYTES_PER_HANDLE = 3 * _I32.itemsize

    def __init__(self, size: int, name: str = "pages"):
        try:
            size = _as_int(size)
        except TypeError:
            raise TypeError(f"{name}: size must be an int, got {type(size).__name__}") from None
        if size <= 0:
            raise ValueError(f"{name}: size must be positive, got {size}")
        if size > self.MAX_SIZE:
            raise ValueError(f"{name}: size {size} does not fit int32 handles")
        self._size = size
        self._name = str(name)
        # Descending stack, so the first allocations hand out low handles.
        # A fixed-capacity stack: _free[:_top] are the free handles. Never resized,
        # so a shrinking free list never pays for a realloc-and-copy.
        # (filled from numpy: an array built from a Python range takes seconds per 10**7)
        self._free = array("i")
        self._free.frombytes(memoryview(np.arange(size - 1, -1, -1, dtype=_I32)).cast("B"))
        self._top = size
        self._state = np.ones(size, dtype=np.int32)
        self._mark = np.arange(1, 1025, dtype=np.int32)
        self._cells = memoryview(self._state)  # fast scalar access to the same memory

    # -- accounting ---------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return self._size

    @property
    def available(self) -> int:
        return self._top

    @property
    def used(self) -> int:
        return self._size - self._top

    def __repr__(self) -> str:
        return f"HandleAllocator({self._name!r}, size={self._size}, used={self.used})"

    # -- hot path -----------------------------------------------------------
    def alloc(self, n: int) -> array:
        """Take ``n`` handles, all or nothing.  Order within the result is
        unspecified (recently freed handles come back first)."""
        n = _as_int(n)
        top = self._top
        start = top - n
        if n <= 0 or start < 0:
            if n == 0:
                return array("i")
            if n < 0:
                raise ValueError(f"{self._name}: cannot allocate a negative count ({n})")
            raise PoolExhausted(
                f"{self._name}: asked for {n} handles, only {top} available"
                f" (size {self._size})"
            )
        out = self._free[start:top]
        self._top = start
        if n <= self.SMALL:
            cells = self._cells
            for h in out:
                cells[h] = 0
        else:
            self._state[np.frombuffer(out, _I32).astype(np.intp)] = 0
        return out

    def free(self, handles) -> None:
        """Give handles back; raises DoubleFree and frees nothing if any is bad."""
        if type(handles) is array and handles.typecode == "i" and len(handles) <= self.SMALL:
            cells, size = self._cells, self._size
            ok = True
            for h in handles:
                if not 0 <= h < size or cells[h]:
                    ok = False
                    break
                cells[h] = -1  # provisional: a repeat within the batch now reads non-zero
            if ok:
                for h in handles:
                    cells[h] = 1
                top = self._top
                self._free[top:top + len(handles)] = handles
                self._top = top + len(handles)
                return
            for h in handles:  # undo the provisional marks, then report like the bulk path
                if 0 <= h < size and cells[h] == -1:
                    cells[h] = 0
        if type(handles) is array and handles.typecode == "i":
            n = len(handles)
            # Read as uint32, negative handles become huge and fail the bounds check.
            pos = np.frombuffer(handles, _U32).astype(np.intp)
        else:
            try:
                idx = as_index_array(handles)
            except _NotInt32 as exc:
                raise DoubleFree(f"{self._name}: {exc}") from None
            n = idx.shape[0]
            if n == 0:
                return
            pos = idx.view(_U32).astype(np.intp)
            handles = array("i", idx.tobytes())
            del idx
        state = self._state
        try:
            before = state[pos]
        except IndexError:
            pos = None
            idx = as_index_array(handles)
            msg = self._range_msg(idx)
        else:
            if before.tobytes() != bytes(4 * n):  # some handle is free already (0: allocated)
                idx = as_index_array(handles)
                msg = f"{self._name}: freeing handles that are not allocated: {_preview(idx[before != 0])}"
            else:
                mark = self._mark
                if mark.shape[0] < n:
                    mark = self._mark = np.arange(1, 2 * n + 1, dtype=np.int32)
                mark = mark[:n]
                state[pos] = mark
                if state[pos].tobytes() == mark.tobytes():
                    top = self._top
                    # all were allocated, so top + n <= size: a same-length slice copy
                    self._free[top:top + n] = handles
                    self._top = top + n
                    return
                state[pos] = 0  # undo: they were all allocated before
                idx = as_index_array(handles)
                msg = self._dup_msg(idx)
        # Drop our views of the caller's buffer before raising, so the
        # traceback does not pin it (a pinned array('i') cannot be resized).
        del idx, pos
        raise DoubleFree(msg)

    # -- queries ------------------------------------------------------------
    def is_allocated(self, handle: int) -> bool:
        h = _as_int(handle)
        return 0 <= h < self._size and not self._state[h]

    def allocated(self) -> array:
        """All currently allocated handles, sorted."""
        out = array("i")
        out.frombytes(np.flatnonzero(self._state == 0).astype(_I32).view(np.uint8))
        return out

    def require_allocated(self, handles, what: str = "handles") -> np.ndarray:
        """Return handles as an int32 array; ValueError unless all are allocated.

        For users of a pool's tensors (copies, clears), where touching a free
        slot would mean writing into memory someone else may soon own.
        """
        try:
            idx = as_index_array(handles)
        except _NotInt32 as exc:
            raise ValueError(f"{self._name}: {what}: {exc}") from None
        if idx.shape[0]:
            pos = idx.view(np.uint32).astype(np.intp)
            if int(pos.max()) >= self._size:
                msg = self._range_msg(idx)
            else:
                st = self._state[pos]
                if not np.count_nonzero(st):
                    return idx
                msg = f"{self._name}: handles not allocated: {_preview(idx[st != 0])}"
            raise ValueError(f"{what}: {msg}")
        return idx

    def check(self) -> None:
        """Raise AssertionError unless free list and ownership state agree."""
        name, size = self._name, self._size
        free = np.array(self._free[:self._top], dtype=np.int64)
        if free.size:
            if free.min() < 0 or free.max() >= size:
                raise AssertionError(f"{name}: free list holds out-of-range handles")
            if np.unique(free).size != free.size:
                raise AssertionError(f"{name}: free list holds duplicates")
            if not self._state[free].all():
                raise AssertionError(f"{name}: a handle is both free and allocated")
        n_alloc = int(np.count_nonzero(self._state == 0))
        if n_alloc + free.size != size:
            raise AssertionError(
                f"{name}: {n_alloc} allocated + {free.size} free != size {size}"
            )

    # -- error messages (cold) ----------------------------------------------
    def _range_msg(self, idx: np.ndarray) -> str:
        wide = idx.astype(np.int64)
        bad = wide[(wide < 0) | (wide >= self._size)]
        return f"{self._name}: handles out of range [0, {self._size}): {_preview(bad)}"

    def _dup_msg(self, idx: np.ndarray) -> str:
        vals, counts = np.unique(idx, return_counts=True)
        return f"{self._name}: handles listed more than once: {_preview(vals[counts > 1])}"
