"""A recurrent (Mamba-style) state: one slot per request, checkpoints at boundaries."""
from __future__ import annotations

from dataclasses import dataclass

from ..memory import MambaStatePool, PoolPlan
from ..tree.component import CheckpointComponent
from .spec import StateSpec


@dataclass(frozen=True)
class RecurrentShape:
    """One recurrent layer's state: the conv window and the recurrent state, with their
    dtypes (torch dtype names; states are usually float32 whatever the weights are)."""

    conv_shape: tuple
    state_shape: tuple
    conv_dtype: str = "float32"
    state_dtype: str = "float32"


@dataclass(frozen=True)
class RecurrentState(StateSpec):
    """Sized by --max-mamba-cache-size (default 4 x --max-running-requests + 64): the
    running requests' own states and the checkpoints the tree keeps."""

    name: str = "mamba"
    checkpoint = True

    def tree_component(self):
        comp = CheckpointComponent()
        comp.name = self.name
        return comp

    def pool_size(self, cache, max_running, page_size):
        n = cache.max_mamba_cache_size
        if n is None:
            n = 4 * max_running + 64
        return n, ("--max-mamba-cache-size",), "the recurrent state pool", "slots"

    def pool_plan(self, layers, *, page_size, size, device, what, flags):
        import torch
        shapes = {ls.shape for ls in layers}
        if len(shapes) > 1:
            raise ValueError(f"{self.name}: layers keep recurrent states of different shapes "
                             f"{sorted(map(str, shapes))}; one pool needs one shape per slot")
        s = shapes.pop()
        shape = dict(conv_shape=s.conv_shape, state_shape=s.state_shape, dtype=getattr(torch, s.conv_dtype),
                     state_dtype=getattr(torch, s.state_dtype))
        return PoolPlan(self.name, MambaStatePool, tuple(ls.layer for ls in layers), size, shape, device,
                        what=what, unit="slots", flags=flags)
