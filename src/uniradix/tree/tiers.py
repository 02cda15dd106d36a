"""Two residencies per slot (device and host): which host-only slots a reuse needs, and
slots a tier gains (a load to the device, a copy to the host)."""
from __future__ import annotations

from array import array

from .node import Node


class Tiers:
    """RadixTree's memory tiers (a mixin: the state lives on the tree)."""

    def _host_only(self, end: Node) -> list[tuple[int, Node]]:
        """(component index, node) of the slots reuse at end.end needs that only the host
        holds, root side first: what a load must bring to the device."""
        loads = []
        for c in self.components:
            lo = c.pin_from(end)
            if lo is None:
                continue
            ci = c.index
            nd = end
            stop = end.parent if lo < 0 else None
            while nd is not stop and nd.parent is not None and nd.end > lo:
                if nd.value[ci] is None:
                    loads.append((ci, nd))
                nd = nd.parent
        loads.reverse()
        return loads

    def handles_at(self, nd: Node) -> dict[str, array]:
        """What match would hand out for a reuse ending at nd (after a load)."""
        path = nd.path()
        return {c.name: c.handles(path, nd.end) for c in self.components}

    def set_device(self, nd: Node, ci: int, handles: array) -> None:
        """The device now holds slot (nd, ci) too (loaded from the host): `handles` are
        the device copy, which the tree owns from now on."""
        self._attach(nd, ci, handles, False)

    def set_host(self, nd: Node, ci: int, handles: array) -> None:
        """The host now holds a copy of slot (nd, ci) (written through, backed up before
        an eviction, or prefetched): `handles` are host handles the tree owns from now on."""
        self._attach(nd, ci, handles, True)

    def _attach(self, nd: Node, ci: int, handles: array, host: bool) -> None:
        tier = nd.host if host else nd.value
        if not nd.attached:
            raise ValueError(f"{nd!r} is no longer in the tree")
        if tier[ci] is not None:
            raise ValueError(f"{nd!r} already holds {self.names[ci]} in the {'host' if host else 'device'} tier")
        c = self.components[ci]
        want = 1 if not c.slices else (nd.end - nd.start) // self.page_size
        if len(handles) != want:
            raise ValueError(f"{self.names[ci]} on {nd!r} takes {want} handles, got {len(handles)}")
        if c.slices and nd.value[ci] is None and nd.host[ci] is None:
            raise ValueError(f"{nd!r}: {self.names[ci]} is a tombstone; a tier copies data, it does not heal")
        tier[ci] = handles
        n = len(handles)
        if host:
            self.hosted = True
            self._single = False
            self.host_size[ci] += n
            if nd.locks[ci]:
                self.host_locked[ci] += n
        else:
            self.size[ci] += n
            if nd.locks[ci]:
                self.locked[ci] += n
        self._place(ci, nd)
        self._place(ci, nd, True)

    def unbacked(self, nd: Node, min_hits: int = 0) -> list[tuple[int, Node]]:
        """(component index, node) of the device slots on the path to nd that the host
        tier has no copy of, root side first, spares aside (room on the device that would
        stand empty, not worth a copy); with `min_hits`, only on nodes accessed at least
        that often (selective write-through)."""
        out = []
        for x in nd.path():
            if x.hits < min_hits:
                continue
            for ci in range(self.nc):
                if x.value[ci] is not None and x.host[ci] is None and not x.spare >> ci & 1:
                    out.append((ci, x))
        return out

    def path_pages(self, path: list, ci: int) -> array:
        """One device handle per page along `path` for page component ci, -1 where a
        node has none (a tombstone, or host-only)."""
        P = self.page_size
        out = array("i")
        for nd in path:
            v = nd.value[ci]
            out += v if v is not None else array("i", (-1,)) * ((nd.end - nd.start) // P)
        return out
