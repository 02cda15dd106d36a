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

    def tree_component(self, keep_spare: bool = False):
        comp = CheckpointComponent()
        comp.name = self.name
        return comp

    def pool_size(self, cache, max_running, page_size):
        n = cache.max_mamba_cache_size
        if n is None:
            n = 4 * max_running + 64
        return n, ("--max-mamba-cache-size",), "the recurrent state pool", "slots"

    def pool_plan(self, layers, *, page_size, size, device, what, flags):
        """One slot holds every recurrent layer's state; layers may differ in shapes and
        dtypes (each shape gets its own buffers in the pool)."""
        import torch

        def dt(name):
            return getattr(torch, name)

        shape = dict(layer_shapes={ls.layer: (tuple(ls.shape.conv_shape), tuple(ls.shape.state_shape),
                                              dt(ls.shape.conv_dtype), dt(ls.shape.state_dtype))
                                   for ls in layers})
        return PoolPlan(self.name, MambaStatePool, tuple(ls.layer for ls in layers), size, shape, device,
                        what=what, unit="slots", flags=flags)
