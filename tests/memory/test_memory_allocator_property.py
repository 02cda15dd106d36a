"""Random alloc/free sequences against a plain Python set model."""

from array import array

import numpy as np
import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from uniradix.memory import DoubleFree, HandleAllocator, PoolExhausted

SIZE = 40

FORMS = [
    lambda h: array("i", h),
    list,
    lambda h: np.array(h, dtype=np.int64),
    lambda h: torch.tensor(h, dtype=torch.int32),
]


class AllocatorModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = HandleAllocator(SIZE, "model")
        self.model: set[int] = set()

    @rule(n=st.integers(0, SIZE + 5))
    def alloc_n(self, n):
        free = SIZE - len(self.model)
        if n > free:
            with pytest.raises(PoolExhausted):
                self.alloc.alloc(n)
            return
        got = list(self.alloc.alloc(n))
        assert len(got) == n == len(set(got))
        assert not (set(got) & self.model)
        assert all(0 <= h < SIZE for h in got)
        self.model |= set(got)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), form=st.sampled_from(FORMS))
    def free_some(self, data, form):
        pick = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True))
        self.alloc.free(form(pick))
        self.model -= set(pick)

    @rule(data=st.data(), form=st.sampled_from(FORMS))
    def bad_free(self, data, form):
        owned = sorted(self.model)
        good = data.draw(st.lists(st.sampled_from(owned), unique=True)) if owned else []
        kinds = ["range"]
        if len(self.model) < SIZE:
            kinds.append("not_allocated")
        if owned:
            kinds.append("duplicate")
        kind = data.draw(st.sampled_from(kinds))
        if kind == "range":
            bad = [data.draw(st.sampled_from([-1, SIZE, SIZE + 7, -SIZE]))]
        elif kind == "not_allocated":
            bad = [data.draw(st.sampled_from(sorted(set(range(SIZE)) - self.model)))]
        else:
            bad = [data.draw(st.sampled_from(owned))]
            good = good + bad if bad[0] not in good else good
        handles = data.draw(st.permutations(good + bad))
        with pytest.raises(DoubleFree):
            self.alloc.free(form(handles))

    @invariant()
    def matches_model(self):
        assert list(self.alloc.allocated()) == sorted(self.model)
        assert self.alloc.available + len(self.alloc.allocated()) == SIZE
        assert self.alloc.used == len(self.model)
        self.alloc.check()


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
