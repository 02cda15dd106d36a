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

    Every layer has the same conv and recurrent state shapes and dtypes, or, with
    ``layer_shapes`` ({layer: (conv_shape, state_shape, conv_dtype, state_dtype)}), its
    own. Layers of one shape share a ``[num_layers, num_slots, ...]`` buffer each for
    conv and state, so a copy or clear is one op per distinct shape.
    """

    kind = "MambaStatePool"

    def __init__(self, layer_ids, num_slots: int, conv_shape=None, state_shape=None,
                 dtype: torch.dtype = torch.float32, device="cpu", *,
                 state_dtype: torch.dtype | None = None, layer_shapes=None, accounting_only: bool = False,
                 name: str = "mamba", pin_memory: bool = False):
        super().__init__(num_slots, name=name, layer_ids=layer_ids, device=device,
                         accounting_only=accounting_only, pin_memory=pin_memory)
        what = f"MambaStatePool {name!r}"
        self._per_layer = _per_layer(self._layer_ids, conv_shape, state_shape, dtype, state_dtype,
                                     layer_shapes, what)
        self._shape = dict(layer_shapes=self._per_layer)
        # layers of one shape share buffers: group index and row within it, per layer
        groups: dict = {}
        for lid, spec in self._per_layer.items():
            groups.setdefault(spec, []).append(lid)
        self._groups = [(spec, tuple(lids)) for spec, lids in groups.items()]
        self._where = {lid: (g, i) for g, (_, lids) in enumerate(self._groups) for i, lid in enumerate(lids)}
        self._bufs: list[tuple[torch.Tensor, torch.Tensor]] = []
        if not self._accounting_only:
            for (conv, state, cdt, sdt), lids in self._groups:
                lead = (len(lids), self.size)
                self._bufs.append(tuple(torch.zeros((*lead, *row), dtype=dt, device=self._device,
                                                    pin_memory=self._pin_memory)
                                        for row, dt in ((conv, cdt), (state, sdt))))

    @staticmethod
    def handle_rows(*, conv_shape, state_shape, dtype: torch.dtype = torch.float32,
                    state_dtype: torch.dtype | None = None):
        """One layer's conv row and recurrent-state row for one slot."""
        return [(shape_tuple(conv_shape, "conv_shape"), dtype),
                (shape_tuple(state_shape, "state_shape"), dtype if state_dtype is None else state_dtype)]

    @classmethod
    def bytes_per_handle_for(cls, num_layers: int, *, layer_shapes=None, **shape) -> int:
        """As the base class, summed over each layer's own shapes when they differ."""
        if layer_shapes is None:
            return super().bytes_per_handle_for(num_layers, **shape)
        return sum(super(MambaStatePool, cls).bytes_per_handle_for(
            1, conv_shape=c, state_shape=st, dtype=cdt, state_dtype=sdt)
            for c, st, cdt, sdt in layer_shapes.values())

    @property
    def num_slots(self) -> int:
        return self.size

    @property
    def layer_shapes(self) -> dict:
        """{layer: (conv_shape, state_shape, conv_dtype, state_dtype)}."""
        return dict(self._per_layer)

    def _uniform(self, k: int):
        specs = {spec[k] for spec in self._per_layer.values()}
        if len(specs) != 1:
            raise ValueError(f"{self.kind} {self._name!r}: layers have different shapes; see layer_shapes")
        return specs.pop()

    @property
    def conv_shape(self) -> tuple[int, ...]:
        return self._uniform(0)

    @property
    def state_shape(self) -> tuple[int, ...]:
        return self._uniform(1)

    @property
    def conv_dtype(self) -> torch.dtype:
        return self._uniform(2)

    @property
    def state_dtype(self) -> torch.dtype:
        return self._uniform(3)

    def _handle_tensors(self) -> list[torch.Tensor]:
        return [t for pair in self._bufs for t in pair]

    def layer_tensors(self, layer_id) -> list[torch.Tensor]:
        g, i = self._where_of(layer_id)
        self._require_tensors()
        return [t[i] for t in self._bufs[g]]

    def _where_of(self, layer_id):
        self._layer(layer_id)  # the error for a layer the pool does not hold
        return self._where[layer_id]

    def conv(self, layer_id: int) -> torch.Tensor:
        """Conv state of one layer: ``[num_slots, *conv_shape]``."""
        g, i = self._where_of(layer_id)
        self._require_tensors()
        return self._bufs[g][0][i]

    def state(self, layer_id: int) -> torch.Tensor:
        """Recurrent state of one layer: ``[num_slots, *state_shape]``."""
        g, i = self._where_of(layer_id)
        self._require_tensors()
        return self._bufs[g][1][i]

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy every layer's conv + recurrent state and every sidecar row
        from slot ``src`` to slot ``dst`` (both must be allocated)."""
        src = self._slot(src, "copy_slot source")
        dst = self._slot(dst, "copy_slot destination")
        if src == dst or self._accounting_only:
            return
        for buf in self._handle_tensors():
            buf[:, dst].copy_(buf[:, src])
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
        for buf in self._handle_tensors():
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
        for buf in self._handle_tensors():
            buf.index_fill_(1, rows, 0)


def _per_layer(layer_ids, conv_shape, state_shape, dtype, state_dtype, layer_shapes, what) -> dict:
    """{layer: (conv_shape, state_shape, conv_dtype, state_dtype)}, checked."""
    if layer_shapes is None:
        if conv_shape is None or state_shape is None:
            raise ValueError(f"{what}: give conv_shape and state_shape, or layer_shapes")
        one = (shape_tuple(conv_shape, f"{what} conv_shape"), shape_tuple(state_shape, f"{what} state_shape"),
               torch_dtype(dtype, f"{what} dtype"),
               torch_dtype(dtype if state_dtype is None else state_dtype, f"{what} state_dtype"))
        return {lid: one for lid in layer_ids}
    if set(layer_shapes) != set(layer_ids):
        raise ValueError(f"{what}: layer_shapes must cover exactly layers {list(layer_ids)}, "
                         f"got {sorted(layer_shapes)}")
    out = {}
    for lid in layer_ids:
        c, s, cdt, sdt = layer_shapes[lid]
        out[lid] = (shape_tuple(c, f"{what} layer {lid} conv shape"), shape_tuple(s, f"{what} layer {lid} state shape"),
                    torch_dtype(cdt, f"{what} layer {lid} conv dtype"), torch_dtype(sdt, f"{what} layer {lid} state dtype"))
    return out
