"""Writing a cache's data to L3 so that a reader can resume from it.

A write covers paths of the tree and sends, for every boundary on them that every
component accepts (its data in either memory tier), what a reader resuming there needs:
the FULL pages before it, each windowed component's pages of the window, the checkpoint
at it. Earlier pages go in the same batch as the later ones or in an earlier one, so the
store never gets a page without what a reader needs before it. Write-through covers a
finished request's path, write-back the paths that read a slot the host is about to
lose, a flush every path of the tree.

Payloads are read from the pools (the device's, or the host's where only the host holds
a slot) on the scheduler's thread (`prepare_*`); the store is asked which keys it lacks
and written on any thread (`commit`). Keys believed stored are not read again, but the
same batched membership call re-checks them, and one found missing is forgotten, so the
next write of its path sends it."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..tree import decode, encode
from ..tree.component import page_ceil, page_floor
from ..tree.tree import intersect
from .codec import handle_nbytes, read_handles, read_sidecar_rows, sidecar_row_nbytes
from .keys import component_key, page_keys
from .objects import pack_object
from .storage import StorageUnavailable

#: what L3Store._claim says of a key a write would send
KNOWN, BUSY, MINE = "known", "busy", "mine"

log = logging.getLogger("uniradix.hicache")

#: keys re-checked in one membership call at most (a flush over a large tree is split)
CHECK_BATCH = 1 << 14


@dataclass
class SaveJob:
    """Payloads to write if the store lacks them, read from the pools on the scheduler's
    thread, committed on any thread. `believed`: keys left out as known to be stored,
    re-checked in the same call; `owners[i]`: the key whose belief believed[i] stands
    for (a sidecar's object stands for its page's). `claimed`: what the job holds back
    from other jobs until it ends."""

    keys: list
    payloads: list
    seed: bytes
    believed: list = field(default_factory=list)
    owners: list = field(default_factory=list)
    claimed: list = field(default_factory=list)
    nbytes: int = 0


class _Batch:
    """A job being gathered: keys with where their payload is (pool or sidecar, handle)."""

    def __init__(self, seed: bytes) -> None:
        self.seed = seed
        self.keys, self.sources, self.handles = [], [], []
        self.believed, self.owners, self.claimed = [], [], []
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.keys) + len(self.believed)


class Writing:
    """L3Store's writes (a mixin: the state lives on the store)."""

    # ------------------------------------------------------------------ what readers need
    def _mark(self, marks: dict, path: list, end: int) -> None:
        """Mark in `marks` (id(node) -> [{component index: page mask}, checkpoint?]) what a
        reader resuming at any boundary in (0, end] of `path` (root side first) needs:
        the boundaries every component accepts there, with data in either memory tier,
        and for each, every page component's pages from its window's start, and the
        checkpoint at it."""
        P = self.P
        cur = None
        for c in self.cache.tree.components:
            a = c.accepted(path, end, True)
            cur = a if cur is None else intersect(cur, a)
        runs = [(max(page_ceil(lo, P), P), hi) for lo, hi in cur]
        runs = [(lo, hi) for lo, hi in runs if lo <= hi]
        if not runs:
            return
        for c in self.comps:
            self._mark_pages(marks, path, c.index, _merged([(c.window_start(lo), hi) for lo, hi in runs]))
        if self.ckpt is not None:
            ci, i = self.ckpt.index, 0
            for nd in path:
                while i < len(runs) and runs[i][1] < nd.end:
                    i += 1
                if i == len(runs):
                    break
                if runs[i][0] <= nd.end and (nd.value[ci] is not None or nd.host[ci] is not None):
                    marks.setdefault(id(nd), [{}, False])[1] = True

    def _mark_pages(self, marks: dict, path: list, ci: int, spans: list) -> None:
        """Mark component ci's pages of the token spans (sorted, disjoint) on `path`."""
        P, i = self.P, 0
        for nd in path:
            while i < len(spans) and spans[i][1] <= nd.start:
                i += 1
            if i == len(spans):
                return
            j = i
            while j < len(spans) and spans[j][0] < nd.end:
                s, e = max(spans[j][0], nd.start), min(spans[j][1], nd.end)
                masks = marks.setdefault(id(nd), [{}, False])[0]
                m = masks.get(ci)
                if m is None:
                    m = masks[ci] = bytearray((nd.end - nd.start) // P)
                m[(s - nd.start) // P:(e - nd.start) // P] = b"\x01" * ((e - s) // P)
                j += 1

    # ------------------------------------------------------------------ jobs from marks
    def _jobs(self, marks: dict, order: list, salt, chunk_bytes: int | None = None,
              send: bool = True, recheck: bool = True):
        """SaveJobs for what `marks` names, node by node in `order` (every node after its
        parent; the nodes on the way to a marked one included, for the key chain), each
        at most about `chunk_bytes` of payload (None: one job). `send`: read and send
        what the store is not known to have; `recheck`: re-check what it is believed to
        have. Generated lazily, so a large write holds one chunk in memory at a time."""
        self._check_generation()
        ns = self._ns(salt)
        batch = _Batch(ns.seed())
        last: dict[int, bytes] = {}
        try:
            for nd in order:
                prev = None if nd.parent.parent is None else last[id(nd.parent)]
                keys = page_keys(decode(nd.key), ns, prev)
                last[id(nd)] = bytes.fromhex(keys[-1])
                m = marks.get(id(nd))
                if m is None:
                    continue
                self._gather(batch, nd, m, keys, send, recheck)
                if chunk_bytes is not None and (batch.nbytes >= chunk_bytes or len(batch) >= CHECK_BATCH):
                    job, batch = self._build(batch), _Batch(batch.seed)
                    if job is not None:
                        yield job
            job, batch = self._build(batch), None
            if job is not None:
                yield job
        finally:
            if batch is not None:  # abandoned or failed half-way: nothing of it stays claimed
                self._release(batch.claimed)

    def _gather(self, batch: _Batch, nd, mark, keys: list, send: bool, recheck: bool) -> None:
        masks, ckpt = mark
        cache = self.cache
        for c in self.comps:
            m = masks.get(c.index)
            if m is None:
                continue
            ci = c.index
            v, pool = nd.value[ci], cache.pools[ci]
            if v is None:
                v, pool = nd.host[ci], cache.host_pools[ci] if cache.host_pools else None
            if v is None:  # never: a boundary a reader accepts has it in some tier
                continue
            sidecars = list(getattr(pool, "sidecars", {}).values())
            for k, want in enumerate(m):
                if want:
                    pk = keys[k]
                    extra = [(sc, component_key(pk, f"{c.name}_{sc.name}")) for sc in sidecars]
                    self._take(batch, self._key(pk, c), pool, v[k], extra, send, recheck)
        if ckpt:
            ci = self.ckpt.index
            v, pool = nd.value[ci], cache.pools[ci]
            if v is None:
                v, pool = nd.host[ci], cache.host_pools[ci] if cache.host_pools else None
            if v is not None:
                self._take(batch, component_key(keys[-1], self.ckpt.name), pool, v[0], [], send, recheck)

    def _take(self, batch: _Batch, key: str, pool, handle: int, extra: list, send: bool, recheck: bool) -> None:
        """One object (and the sidecar rows riding with it) for the batch: sent when the
        store is not known to have it, re-checked when it is."""
        how = self._claim(key) if send else KNOWN if self._is_known(key) else None
        if how == KNOWN:
            if recheck:
                for k in (key, *(k for _, k in extra)):
                    batch.believed.append(k)
                    batch.owners.append(key)
            return
        if how != MINE:  # another job already sends it (BUSY), or this one sends nothing
            return
        batch.claimed.append(hash(key))
        batch.keys.append(key)
        batch.sources.append((pool, False))
        batch.handles.append(handle)
        batch.nbytes += self._nbytes(pool, False)
        for sc, k in extra:
            batch.keys.append(k)
            batch.sources.append((sc, True))
            batch.handles.append(handle)
            batch.nbytes += self._nbytes(sc, True)

    def _nbytes(self, src, sidecar: bool) -> int:
        n = self._sizes.get(id(src))
        if n is None:
            n = self._sizes[id(src)] = sidecar_row_nbytes(src) if sidecar else handle_nbytes(src)
        return n

    def _build(self, batch: _Batch) -> SaveJob | None:
        """Read the batch's payloads (one gather per pool) into a SaveJob; None when it
        has nothing to send or check."""
        if not len(batch):
            return None
        payloads = [b""] * len(batch.keys)
        groups: dict[int, tuple] = {}
        for i, ((src, sidecar), h) in enumerate(zip(batch.sources, batch.handles)):
            g = groups.get(id(src))
            if g is None:
                g = groups[id(src)] = (src, sidecar, [], [])
            g[2].append(i)
            g[3].append(h)
        for src, sidecar, pos, hs in groups.values():
            for i, data in zip(pos, (read_sidecar_rows if sidecar else read_handles)(src, hs)):
                payloads[i] = data
        return SaveJob(batch.keys, payloads, batch.seed, batch.believed, batch.owners, batch.claimed,
                       batch.nbytes)

    # ------------------------------------------------------------------ the writes
    def prepare_path(self, end, min_hits: int = 0) -> SaveJob | None:
        """What a reader resuming at any boundary on the path to node `end` needs and the
        store is not known to have, read from whichever tier holds it (the scheduler's
        thread). With `min_hits`, the path stops at the first node accessed fewer times
        (selective write-through: only what is reused goes down)."""
        path = end.path()
        if min_hits:
            cut = next((i for i, nd in enumerate(path) if nd.hits < min_hits), len(path))
            path = path[:cut]
        if not path:
            return None
        marks: dict = {}
        self._mark(marks, path, path[-1].end)
        return next(self._jobs(marks, path, self._salt_of(path[0])), None)

    def prepare_cached(self, tokens, salt=None, min_hits: int = 0) -> SaveJob | None:
        """The write-through of a finished request: prepare_path at the deepest node the
        tree holds whole along `tokens`."""
        tree = self.cache.tree
        key = encode(list(tokens))
        root = tree.find_root(salt)
        if root is None:
            return None
        nd, off = root, 0
        while True:  # whole nodes along tokens; read-only (a match would split and touch)
            ch = nd.children.get(key[off:off + tree.unit])
            if ch is None or not key.startswith(ch.key, off):
                break
            off += len(ch.key)
            nd = ch
        return None if nd is root else self.prepare_path(nd, min_hits)

    def prepare_write_back(self, nd, ci: int) -> SaveJob | None:
        """Slot (nd, ci) is about to be lost (the host tier evicts its last copy): what
        the boundaries that read it need, read now. Those are on the path to nd and,
        below it, as far as component ci reads back (its `reach`: a window's W - 1
        tokens; every boundary below for FULL, whose last copy only a leaf loses); each
        goes down with the earlier pages and the other components' data it needs."""
        path = nd.path()
        marks: dict = {}
        self._mark(marks, path, nd.end)
        order = list(path)
        reach = self.cache.tree.components[ci].reach
        if nd.children and (reach is None or reach > 0):
            limit = None if reach is None else page_floor(nd.end + reach, self.P)
            stack = [(ch, path + [ch]) for ch in nd.children.values()]
            while stack:
                d, dpath = stack.pop()
                order.append(d)
                if limit is not None and d.end >= limit:
                    self._mark(marks, dpath, limit)
                    continue
                if not d.children:
                    self._mark(marks, dpath, d.end)
                stack += [(ch, dpath + [ch]) for ch in d.children.values()]
        return next(self._jobs(marks, order, self._salt_of(path[0])), None)

    def prepare_all(self, min_hits: int = 0, chunk_bytes: int | None = None, send: bool = True,
                    recheck: bool = True):
        """Every path of the tree, for a flush or a shutdown: SaveJobs, generated lazily
        root side first, each of about `chunk_bytes` of payload (see `_jobs` for `send`
        and `recheck`). With `min_hits` a path stops at the first node accessed fewer
        times, as selective write-through's do."""
        tree = self.cache.tree
        for root in list(tree.roots.values()):
            marks: dict = {}
            order: list = []
            stack = [(ch, [ch]) for ch in root.children.values() if ch.hits >= min_hits]
            while stack:
                nd, path = stack.pop()
                order.append(nd)
                kids = [ch for ch in nd.children.values() if ch.hits >= min_hits]
                if not kids or len(kids) < len(nd.children):  # a path ends here
                    self._mark(marks, path, nd.end)
                stack += [(ch, path + [ch]) for ch in kids]
            if marks:
                yield from self._jobs(marks, order, tree.salt_of(root), chunk_bytes, send, recheck)

    def _salt_of(self, nd):
        while nd.parent is not None:
            nd = nd.parent
        return self.cache.tree.salt_of(nd)

    def commit(self, job: SaveJob | None) -> int:
        """Write what the store lacks of `job` and re-check what it was believed to have
        (one batched membership call, one batched set; any thread). Returns the objects
        written. A store that fails costs only this write: it is counted (errors,
        failed_sets) and logged, never raised."""
        if job is None:
            return 0
        try:
            return self._commit(job)
        finally:
            self._release(job.claimed)

    def _commit(self, job: SaveJob) -> int:
        self._check_generation()
        n = len(job.keys)
        try:
            have = self.backend.batch_contains(job.keys + job.believed)
            if job.believed:
                lost = {o for o, h in zip(job.owners, have[n:]) if not h}
                if lost:  # the store lost them: the next write of their path sends them again
                    self._forget(lost)
                    self._count("lost", len(lost))
                self._remember(o for o in dict.fromkeys(job.owners) if o not in lost)
            self._remember(k for k, h in zip(job.keys, have) if h)
            todo = [i for i in range(n) if not have[i]]
            if not todo:
                return 0
            keys = [job.keys[i] for i in todo]
            ok = self.backend.batch_set(keys, [pack_object(k, job.payloads[i], job.seed, self.secret, self.writer)
                                               for k, i in zip(keys, todo)])
        except StorageUnavailable as e:
            self.forget_all()  # it may have lost anything
            self._count("errors")
            self._warn.failure("writes skipped (store unavailable)", "a write was skipped: %s", e)
            return 0
        except Exception:  # a backend bug: the cache keeps serving, the write is lost
            self.forget_all()
            self._count("errors")
            log.exception("L3 write failed")
            return 0
        self._remember(k for k, good in zip(keys, ok) if good)
        written = sum(ok)
        self._count("saved_objects", written)
        self._count("saved_bytes", sum(len(job.payloads[i]) for i, good in zip(todo, ok) if good))
        self._count("failed_sets", len(ok) - written)
        return written

    def discard(self, job: SaveJob | None) -> None:
        """A prepared job that will never be committed (dropped): its keys may be
        claimed by the next write."""
        if job is not None:
            self._release(job.claimed)

    def save_cached(self, tokens, salt=None, min_hits: int = 0) -> int:
        """prepare_cached then commit, here and now. Returns the objects written."""
        return self.commit(self.prepare_cached(tokens, salt, min_hits))


def _merged(spans: list) -> list:
    """Sorted, overlapping or touching spans joined."""
    spans.sort()
    out: list = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out
