"""The host tier (L2): host mirrors of every device pool, and the data that moves between
them. It loads what a match needs from the host (layer by layer, under the forward),
copies device data to the host as the write policy says (`write_through` when a request
is cached, `write_through_selective` once a node was accessed enough, `write_back` as a
slot leaves the device), keeps what L3 reads through the host (`Staged`) until the
request is cached, and hands what the host is about to lose to the tier below (`lower`:
the L3 tier, under write_back). Allocation and freeing go through the cache's ledger."""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

from ..memory.host import copy_handles
from .codec import write_handles, write_sidecar_rows
from .transfer import CopyJob, LayerwiseLoad

_NEG = array("i", (-1,))


@dataclass
class Staged:
    """Host copies of what a request read from L3 through the host tier, its own until it
    is cached: `pages[ci]` {page index: (device handle, host handle)} of page components;
    `slots` host copies of state slots (they only carried the data on: nothing to keep)."""

    pages: dict = field(default_factory=dict)
    slots: dict = field(default_factory=dict)  # {ci: [host handles]}

    def handles(self) -> dict[int, list]:
        """Every host handle it holds, per component index (for an audit)."""
        out: dict[int, list] = {}
        for ci, pages in self.pages.items():
            out.setdefault(ci, []).extend(h for _, h in pages.values())
        for ci, hs in self.slots.items():
            out.setdefault(ci, []).extend(hs)
        return out


class HostTier:
    """tree, pools (device, by component index), host_pools (by component index), the
    write policy and its threshold. `ledger` (set by the cache) allocates and frees;
    `lower` (set by the L3 tier under write_back) takes what the host is about to lose."""

    def __init__(self, tree, pools: list, host_pools: list, write_policy: str, write_min_hits: int,
                 checkpoint_index: int | None) -> None:
        self.tree = tree
        self.device = pools
        self.pools = host_pools
        self.write_policy = write_policy
        self.write_min_hits = write_min_hits
        self.ckpt = checkpoint_index
        self.page_size = tree.page_size
        self.ledger = None
        self.lower = None
        self.pending: list = []  # layer-by-layer loads the next reader of the pools waits for
        self.layer_ids = sorted({lid for p in pools for lid in getattr(p, "layer_ids", ())})
        self.counters = dict(loads=0, loaded_handles=0, failed_loads=0, written_handles=0, skipped_writes=0,
                             written_back=0, staged_from_storage=0, adopted=0)
        # host -> device loads that ended, by what they carried (host hits; data read from
        # L3 through the host): bytes, the copy thread's wall and CPU seconds (see
        # LayerwiseLoad); staged_write_s: landing L3 data in the host pools; load_wait_s:
        # the scheduler's thread blocked on loads (the forward's wait_layer, and sync)
        for kind in ("load", "staged_load"):
            self.counters.update({f"{kind}_bytes": 0, f"{kind}_copy_s": 0.0, f"{kind}_copy_cpu_s": 0.0})
        self.counters.update(staged_write_s=0.0, load_wait_s=0.0)

    # ------------------------------------------------------------------ loads to the device
    def load(self, loads, got: list) -> list[CopyJob]:
        """Give every host-only slot of `loads` ((ci, node) from a match) device handles
        from the front of `got[ci]` (the rest stays the request's) and return the copies
        that fill them (one job per component)."""
        src: dict[int, array] = {}
        dst: dict[int, array] = {}
        for ci, nd in loads:
            hh = nd.host[ci]
            n = len(hh)
            h = got[ci][:n]
            got[ci] = got[ci][n:]
            self.tree.set_device(nd, ci, h)
            src.setdefault(ci, array("i")).extend(hh)
            dst.setdefault(ci, array("i")).extend(h)
        self.counters["loads"] += 1
        self.counters["loaded_handles"] += sum(len(h) for h in dst.values())
        return [CopyJob(self.pools[ci], src[ci], self.device[ci], dst[ci]) for ci in src]

    def job(self, ci: int, host_handles, device_handles) -> CopyJob:
        return CopyJob(self.pools[ci], host_handles, self.device[ci], device_handles)

    def start(self, jobs: list[CopyJob], kind: str = "load") -> None:
        """Start loading `jobs` layer by layer; `kind` names the counters it adds to once
        it has ended ("load": host hits, "staged_load": L3 data through the host)."""
        if jobs:
            ld = LayerwiseLoad(jobs, self.layer_ids)
            ld.kind = kind
            self.pending.append(ld.start())

    def wait_layer(self, layer_id: int) -> None:
        """Block until every pending load has copied `layer_id` (the forward's hook)."""
        t0 = time.perf_counter()
        for ld in self.pending:
            ld.wait(layer_id)
        self.counters["load_wait_s"] += time.perf_counter() - t0

    def sync(self) -> None:
        """Wait for every pending load to end (before device data is read other than by
        the forward, or a loaded page could be reused)."""
        if not self.pending:
            return
        loads, self.pending = self.pending, []
        t0 = time.perf_counter()
        try:
            for ld in loads:
                ld.wait_all()
        finally:
            c = self.counters
            c["load_wait_s"] += time.perf_counter() - t0
            for ld in loads:
                if ld.done and ld.error is None:
                    c[f"{ld.kind}_bytes"] += ld.nbytes
                    c[f"{ld.kind}_copy_s"] += ld.copy_s
                    c[f"{ld.kind}_copy_cpu_s"] += ld.cpu_s

    # ------------------------------------------------------------------ copies down
    def copy_down(self, ev) -> array | None:
        """A device eviction plan's COPY_DOWN slot: copy it to new host handles (evicting
        host data to make room) when it must survive (FULL over host-only children) or
        the policy is write_back; None when it goes without a copy (under write_back,
        what the host could not take goes to the tier below first)."""
        if not ev.must_copy and self.write_policy != "write_back":
            return None
        nd, ci, v = ev.node, ev.ci, ev.value
        need = [0] * len(self.pools)
        need[ci] = len(v)
        got = self.ledger.alloc_host(need)
        if got is None or not nd.attached or nd.value[ci] is not v:
            if got is not None:
                self.ledger.free_host(ci, got[ci])
            elif self.lower is not None and nd.attached and nd.value[ci] is v:
                self.lower.write_back_node(nd, ci)
            self.counters["skipped_writes"] += len(v)
            return None
        copy_handles(self.device[ci], v, self.pools[ci], got[ci])
        self.counters["written_back"] += len(v)
        return got[ci]

    def write_down(self, ev) -> None:
        """A host eviction plan's LOSE slot: under write_back, what the host alone holds
        goes to the tier below first, with what a reader needs along with it."""
        if self.lower is not None and ev.node.value[ev.ci] is None:
            self.lower.write_back_node(ev.node, ev.ci)

    def write_through(self, node, min_hits: int | None = None, staged: Staged | None = None) -> int:
        """Give the device slots on the path to `node` that the host has no copy of a
        host copy (the write policy's L1 -> L2 step after a request is cached); with
        `write_through_selective` only on nodes accessed often enough; with `write_back`
        nothing is copied here. `staged` host pages that already hold a slot's data (read
        from L3 through the host) are taken as they are, whatever the policy, and leave
        `staged`. Returns the handles copied; none when the host cannot make room."""
        if not node.attached:
            return 0
        todo, need = self._to_write(node, min_hits, staged)
        if not todo:
            return 0
        self.sync()
        rc = self.tree.lock(node)  # a host eviction to make room must not take this path
        try:
            n = self._write(todo, need, staged)
        finally:
            self.ledger.free(self.tree.unlock(rc))
        self.counters["written_handles"] += n
        return n

    def _to_write(self, node, min_hits, staged):
        """(ci, node, host handles already staged or None) per slot to write, and the new
        host handles each component needs."""
        copying = self.write_policy != "write_back"
        hits = self.write_min_hits if min_hits is None else min_hits
        P = self.page_size
        todo, need = [], [0] * len(self.pools)
        for ci, nd in self.tree.unbacked(node):
            v = nd.value[ci]
            pages = staged.pages.get(ci) if staged else None
            have = None
            if pages:
                first = nd.start // P
                have = array("i", (x[1] if x is not None and x[0] == d else -1
                                   for x, d in zip((pages.get(first + k) for k in range(len(v))), v)))
            missing = len(v) if have is None else have.count(-1)
            if missing and (not copying or nd.hits < hits):
                continue
            todo.append((ci, nd, have))
            need[ci] += missing
        return todo, need

    def _write(self, todo, need, staged) -> int:
        got = self.ledger.alloc_host(need) if any(need) else [None] * len(need)
        if got is None:
            self.counters["skipped_writes"] += sum(need)
            todo = [t for t in todo if t[2] is not None and -1 not in t[2]]
            got = [None] * len(need)
        src: dict[int, array] = {}
        dst: dict[int, array] = {}
        P = self.page_size
        for ci, nd, have in todo:
            v = nd.value[ci]
            if have is None:
                have = _NEG * len(v)
            n = have.count(-1)
            h = got[ci][:n] if n else array("i")
            if n:
                got[ci] = got[ci][n:]
            if not nd.attached or nd.host[ci] is not None or nd.value[ci] is not v:
                self.ledger.free_host(ci, h)  # gone or changed while making room
                continue
            k = 0
            for i, x in enumerate(have):
                if x < 0:
                    have[i] = h[k]
                    src.setdefault(ci, array("i")).append(v[i])
                    k += 1
            dst.setdefault(ci, array("i")).extend(h)
            self.tree.set_host(nd, ci, have)
            if staged and ci in staged.pages:
                first, pages = nd.start // P, staged.pages[ci]
                for i in range(len(v)):
                    pages.pop(first + i, None)
                self.counters["adopted"] += len(v) - n
        for ci in src:
            copy_handles(self.device[ci], src[ci], self.pools[ci], dst[ci])
        return sum(len(h) for h in dst.values())

    # ------------------------------------------------------------------ L3 data through the host
    def stage(self, staged: Staged, fetched, b: int) -> bool:
        """Land data read from L3 (an L3 fetch naming the request's own device handles)
        in host handles, and load it from there into those device handles layer by layer.
        The host copies of pages stay in `staged` until the request is cached. False, with
        nothing written, when the host cannot make room."""
        index = {id(p): ci for ci, p in enumerate(self.device)}
        need = [0] * len(self.pools)
        for target, hs, _, sidecar in fetched.plan:
            if not sidecar:
                need[index[id(target)]] += len(hs)
        hh = self.ledger.alloc_host(need)
        if hh is None:
            return False
        t0 = time.perf_counter()
        jobs, host, host_h = [], None, None
        for (target, hs, _, sidecar), blobs in zip(fetched.plan, fetched.blobs):
            if sidecar:  # rows of the pool entry just before it, on the same handles
                write_sidecar_rows(host.sidecars[target.name], host_h, blobs)
                continue
            ci = index[id(target)]
            host = self.pools[ci]
            host_h, hh[ci] = hh[ci][:len(hs)], hh[ci][len(hs):]
            write_handles(host, host_h, blobs)
            jobs.append(CopyJob(host, host_h, target, array("i", hs)))
            if ci == self.ckpt:  # a state slot moves on: nothing to keep
                staged.slots.setdefault(ci, []).extend(host_h)
                continue
            first = b // self.page_size - len(hs)
            pages = staged.pages.setdefault(ci, {})
            for k, (d, h) in enumerate(zip(hs, host_h)):
                pages[first + k] = (d, h)
        self.counters["staged_write_s"] += time.perf_counter() - t0
        self.start(jobs, "staged_load")
        self.counters["staged_from_storage"] += sum(need)
        return True

    def adopt(self, staged: Staged, node) -> None:
        """The request is cached (or released: node None): the tree takes its staged host
        pages as host copies where they hold a node's data; the rest are freed."""
        if node is not None and node.parent is not None:
            self.write_through(node, staged=staged)
        for ci, pages in staged.pages.items():
            self.ledger.free_host(ci, array("i", (h for _, h in pages.values())))
        for ci, hs in staged.slots.items():
            self.ledger.free_host(ci, hs)
        staged.pages.clear()
        staged.slots.clear()

    def stats(self, names: list[str]) -> dict:
        return dict(self.counters, write_policy=self.write_policy)
