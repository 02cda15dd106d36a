"""Recurrent (MAMBA) state slots: conv state plus SSM state per layer."""

from __future__ import annotations

import numpy as np
import torch

from ._checks import shape_tuple, torch_dtype
from .pool import HandlePool, index_tensor

__all__ = ["MambaStatePool"]


class MambaStatePool(HandlePool):
    """Per-slot recurrent state for ``layer_ids``; a slot handle indexes every
    layer.

    The tree keeps checkpoints as slots and forks them copy-on-write, hence
    ``copy_slot(s)``.  ``alloc`` does not clear state (a fork overwrites it
    anyway); call ``zero_slots`` before starting a sequence from scratch.
    Conv and recurrent state live in one ``[num_layers, num_slots, ...]``
    buffer each, so a copy or clear is one op for all layers.
    """

    kind = "MambaStatePool"

    def __init__(self, layer_ids, num_slots: int, conv_shape, state_shape,
                 dtype: torch.dtype = torch.float32, device="cpu", *,
                 state_dtype: torch.dtype | None = None, accounting_only: bool = False,
                 name: str = "mamba", pin_memory: bool = False):
        super().__init__(num_slots, name=name, layer_ids=layer_ids, device=device,
                         accounting_only=accounting_only, pin_memory=pin_memory)
        self._conv_shape = shape_tuple(conv_shape, f"MambaStatePool {name!r} conv_shape")
        self._state_shape = shape_tuple(state_shape, f"MambaStatePool {name!r} state_shape")
        self._conv_dtype = torch_dtype(dtype, f"MambaStatePool {name!r} dtype")
        self._state_dtype = torch_dtype(dtype if state_dtype is None else state_dtype,
                                        f"MambaStatePool {name!r} state_dtype")
        self._shape = dict(conv_shape=self._conv_shape, state_shape=self._state_shape,
                           dtype=self._conv_dtype, state_dtype=self._state_dtype)
        self._conv = self._state = None
        if not self._accounting_only:
            self._conv, self._state = self._zeros()

    @staticmethod
    def handle_rows(*, conv_shape, state_shape, dtype: torch.dtype = torch.float32,
                    state_dtype: torch.dtype | None = None):
        """One layer's conv row and recurrent-state row for one slot."""
        return [(shape_tuple(conv_shape, "conv_shape"), dtype),
                (shape_tuple(state_shape, "state_shape"), dtype if state_dtype is None else state_dtype)]

    @property
    def num_slots(self) -> int:
        return self.size

    @property
    def conv_shape(self) -> tuple[int, ...]:
        return self._conv_shape

    @property
    def state_shape(self) -> tuple[int, ...]:
        return self._state_shape

    @property
    def conv_dtype(self) -> torch.dtype:
        return self._conv_dtype

    @property
    def state_dtype(self) -> torch.dtype:
        return self._state_dtype

    def _handle_tensors(self) -> list[torch.Tensor]:
        return [self._conv, self._state]

    def conv(self, layer_id: int) -> torch.Tensor:
        """Conv state of one layer: ``[num_slots, *conv_shape]``."""
        i = self._layer(layer_id)
        self._require_tensors()
        return self._conv[i]

    def state(self, layer_id: int) -> torch.Tensor:
        """Recurrent state of one layer: ``[num_slots, *state_shape]``."""
        i = self._layer(layer_id)
        self._require_tensors()
        return self._state[i]

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy every layer's conv + recurrent state and every sidecar row
        from slot ``src`` to slot ``dst`` (both must be allocated)."""
        src = self._slot(src, "copy_slot source")
        dst = self._slot(dst, "copy_slot destination")
        if src == dst or self._accounting_only:
            return
        self._conv[:, dst].copy_(self._conv[:, src])
        self._state[:, dst].copy_(self._state[:, src])
        for sc in self._live_sidecars:
            sc._copy_row(src, dst)

    def copy_slots(self, src_handles, dst_handles) -> None:
        """Batched ``copy_slot``: ``src_handles[i] -> dst_handles[i]``.

        Sources are read before any destination is written, so the two lists
        may overlap; a destination may appear only once.
        """
        alloc = self._allocator
        src = alloc.require_allocated(src_handles, "copy_slots source")
        dst = alloc.require_allocated(dst_handles, "copy_slots destination")
        if src.shape[0] != dst.shape[0]:
            raise ValueError(
                f"copy_slots: {src.shape[0]} sources but {dst.shape[0]} destinations"
            )
        if dst.shape[0] == 0:
            return
        if np.unique(dst).shape[0] != dst.shape[0]:
            raise ValueError("copy_slots: a destination slot is listed more than once")
        if self._accounting_only:
            return
        si = index_tensor(src, self._device)
        di = index_tensor(dst, self._device)
        for buf in (self._conv, self._state):
            buf.index_copy_(1, di, buf.index_select(1, si))
        for sc in self._live_sidecars:
            sc._copy_rows(si, di)

    def zero_slots(self, handles) -> None:
        """Clear every layer's conv + recurrent state of allocated ``handles``
        (sidecars are left alone: they were zeroed at alloc)."""
        idx = self._allocator.require_allocated(handles, "zero_slots")
        if idx.shape[0] == 0 or self._accounting_only:
            return
        rows = index_tensor(idx, self._device)
        self._conv.index_fill_(1, rows, 0)
        self._state.index_fill_(1, rows, 0)
