"""Writing a cache's data to L3: payloads read from the pools on the scheduler's
thread (`prepare_*`), then the store asked which keys it lacks and written (`commit`,
any thread)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from array import array

from ..tree import decode, encode
from .codec import read_handles, read_sidecar_rows
from .keys import component_key, page_keys
from .objects import pack_object
from .storage import StorageUnavailable

log = logging.getLogger("uniradix.hicache")

_NEG = array("i", (-1,))


@dataclass
class SaveJob:
    """Payloads to write if the store lacks them; built on the scheduler's thread from
    the pools, committed on any thread."""

    keys: list
    payloads: list
    seed: bytes



class Writing:
    """L3Store's writes (a mixin: the state lives on the store)."""

    def prepare_save(self, tokens, pages: dict, checkpoints: dict | None = None, salt=None,
                     pools: list | None = None) -> SaveJob | None:
        """What a save would write, read from the pools now (the scheduler's thread):
        for each page component the pages of `pages[name]` that are present (>= 0),
        their sidecar rows, and checkpoint slots at their page-aligned positions; keys
        remembered as present in the store are left out. The handles index `pools` (by
        component index; default the cache's device pools; the host pools for a
        write-back from the host tier). None when there is nothing to write."""
        pools = self.cache.pools if pools is None else pools
        ns = self._ns(salt)
        keys = page_keys(tokens, ns)
        out_k, out_v = [], []
        for c in self.comps:
            pool = pools[c.index]
            hs = pages.get(c.name)
            if hs is None:
                continue
            pos = [i for i in range(min(len(hs), len(keys))) if hs[i] >= 0
                   and not self._is_known(self._key(keys[i], c))]
            if not pos:
                continue
            handles = [hs[i] for i in pos]
            out_k += [self._key(keys[i], c) for i in pos]
            out_v += read_handles(pool, handles)
            for sc, sks in self._sidecar_keys(pool, c, [keys[i] for i in pos]):
                out_k += sks
                out_v += read_sidecar_rows(sc, handles)
        if self.ckpt is not None and checkpoints:
            pool = pools[self.ckpt.index]
            name = self.ckpt.name
            pos = [p for p in sorted(checkpoints) if p % self.P == 0 and 0 < p <= len(keys) * self.P
                   and not self._is_known(component_key(keys[p // self.P - 1], name))]
            if pos:
                out_k += [component_key(keys[p // self.P - 1], name) for p in pos]
                out_v += read_handles(pool, [checkpoints[p] for p in pos])
        if not out_k:
            return None
        return SaveJob(out_k, out_v, ns.seed())

    def commit(self, job: SaveJob | None) -> int:
        """Write what the store lacks of `job` (one batched membership call, one batched
        set; any thread). Returns the objects written. A store that fails costs only
        this write: it is counted (errors, failed_sets) and logged, never raised."""
        if job is None:
            return 0
        try:
            have = self.backend.batch_contains(job.keys)
            self._remember(k for k, h in zip(job.keys, have) if h)
            todo = [i for i, h in enumerate(have) if not h]
            if not todo:
                return 0
            keys = [job.keys[i] for i in todo]
            ok = self.backend.batch_set(keys, [pack_object(k, job.payloads[i], job.seed, self.secret)
                                               for k, i in zip(keys, todo)])
        except StorageUnavailable as e:
            self._count("errors")
            self._warn.failure("writes skipped (store unavailable)", "a write was skipped: %s", e)
            return 0
        except Exception:  # a backend bug: the cache keeps serving, the write is lost
            self._count("errors")
            log.exception("L3 write failed")
            return 0
        self._remember(k for k, good in zip(keys, ok) if good)
        n = sum(ok)
        self._count("saved_objects", n)
        self._count("saved_bytes", sum(len(job.payloads[i]) for i, good in zip(todo, ok) if good))
        self._count("failed_sets", len(ok) - n)
        return n

    def save(self, tokens, pages: dict, checkpoints: dict | None = None, salt=None,
             pools: list | None = None) -> int:
        """prepare_save then commit, here and now. Returns the objects written."""
        return self.commit(self.prepare_save(tokens, pages, checkpoints, salt, pools))

    def prepare_cached(self, tokens, salt=None, min_hits: int = 0) -> SaveJob | None:
        """The write-through of a finished request: what the cache's tree holds along
        `tokens` (every page still there, every checkpoint on the path). With
        `min_hits`, the path stops at the first node accessed fewer times (selective
        write-through: only what is reused goes down)."""
        tree = self.cache.tree
        key = encode(list(tokens))
        root = tree.find_root(salt)
        if root is None:
            return None
        nd, off, path = root, 0, []
        while True:  # whole nodes along tokens; read-only (a match would split and touch)
            ch = nd.children.get(key[off:off + tree.unit])
            if ch is None or not key.startswith(ch.key, off) or ch.hits < min_hits:
                break
            path.append(ch)
            off += len(ch.key)
            nd = ch
        if not path:
            return None
        pages, ckpts = {}, {}
        for c in self.comps:
            pages[c.name] = tree.path_pages(path, c.index)
        if self.ckpt is not None:
            ci = self.ckpt.index
            for nd in path:
                v = nd.value[ci]
                if v is not None:
                    ckpts[nd.end] = v[0]
        return self.prepare_save(list(tokens)[:path[-1].end], pages, ckpts, salt)

    def save_cached(self, tokens, salt=None, min_hits: int = 0) -> int:
        """prepare_cached then commit, here and now. Returns the objects written."""
        return self.commit(self.prepare_cached(tokens, salt, min_hits))

    def prepare_host_node(self, nd) -> SaveJob | None:
        """Write-back from the host tier: what node `nd` holds only on the host (its
        pages, its checkpoint), read before the host lets go of it."""
        tree = self.cache.tree
        root = nd
        while root.parent is not None:
            root = root.parent
        salt = tree.salt_of(root)
        path = nd.path()
        tokens = decode(b"".join(x.key for x in path))
        P = self.P
        pages, ckpts = {}, {}
        for c in self.comps:
            h = nd.host[c.index]
            if h is not None and nd.value[c.index] is None:
                pages[c.name] = _NEG * (nd.start // P) + h
        if self.ckpt is not None:
            h = nd.host[self.ckpt.index]
            if h is not None and nd.value[self.ckpt.index] is None:
                ckpts[nd.end] = h[0]
        if not pages and not ckpts:
            return None
        return self.prepare_save(tokens, pages, ckpts, salt, pools=self.cache.host_pools)

    def save_host_node(self, nd) -> int:
        return self.commit(self.prepare_host_node(nd))
