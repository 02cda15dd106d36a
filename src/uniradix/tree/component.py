"""What a component is to the tree: its reuse rule, how its value splits, what it pins.

The tree's walks (match, insert, lock, evict) only call the methods below, so a new
kind of layer is one new subclass. Two families cover the known layers:

- `PageComponent`: one handle per page along the span (FULL, SWA, compressed KV).
  With `window=None` it must be present on every page of the prefix; with a window W
  only on the pages touching [first_visible(b, W), b): the W - 1 tokens before b.
- `CheckpointComponent`: one handle at the node's end (a recurrent-state checkpoint),
  valid only at exactly that boundary.

Values are `array('i')` of handles; None is absent (never stored, or tombstoned).
"""
from __future__ import annotations

from array import array

Interval = tuple[int, int]


def first_visible(pos, window):
    """The first key a query at `pos` reads under a sliding window of `window` keys
    (itself included: keys j with pos - window < j <= pos, as the Hugging Face families
    do). The one definition of the window: the tree's reuse rule and the model's mask
    both call it; `pos` may be an int or a tensor."""
    return pos - window + 1


def page_floor(x: int, page: int) -> int:
    return x // page * page


def page_ceil(x: int, page: int) -> int:
    return -(-x // page) * page


class Component:
    name = "?"
    unit = "pages"
    #: the component that defines the tree's shape: only leaves may lose it
    structural = False
    #: slice the value when a node splits (per-page data); otherwise it stays with the lower part
    slices = True
    #: how many tokens before a boundary reuse there reads, so how far below a tombstone a
    #: leaf's own boundary depends on it (None: everything below)
    reach: int | None = 0
    #: False when plan() always says "no splits, keep everything": the tree skips the call
    plans = True
    #: one handle per request (a recurrent state), valid at one boundary, rather than per page
    checkpoint = False
    #: keeps what no resume point needs as spares (PageComponent)
    keep_spare = False

    def __init__(self) -> None:
        self.index = -1
        self.page = 1

    def bind(self, index: int, page: int) -> None:
        self.index = index
        self.page = page

    @property
    def evict_kw(self) -> str:
        return f"{self.name}_{self.unit}"

    # --- reuse rule -------------------------------------------------------------
    def accepted(self, path: list, matched: int, host: bool = True) -> list[Interval]:
        """Boundaries in [0, matched] this component alone accepts on `path`, as sorted
        disjoint closed intervals; (0, 0) is always included. With `host`, a slot held
        only by the host tier counts (it can be loaded); without, only device data does."""
        raise NotImplementedError

    def accepts_end(self, nd) -> bool:
        """Whether the boundary at nd.end is valid for this component (leaf usefulness),
        with data in either memory tier."""
        raise NotImplementedError

    def handles(self, path: list, b: int) -> array:
        """Device handles a request reuses when it resumes at boundary b (path ends at b);
        slots held only by the host must be loaded first."""
        raise NotImplementedError

    def pin_from(self, nd) -> int | None:
        """A lock or session reference at nd pins this component's slot on every path
        node with end > the returned position; -1 pins nd alone (its value never moves
        to another node); None pins nothing."""
        raise NotImplementedError

    # --- insert -----------------------------------------------------------------
    def plan(self, n: int, resume_points: tuple, incoming, prefix_len: int, out: array,
             running: bool = False):
        """For an insert of n tokens, with `resume_points` the page-aligned positions later
        requests should be able to resume at (`running`: the insert of a request that goes
        on, whose end is not one): (positions where nodes must split so values attach
        to whole nodes, what to keep (passed back to adopt/reconcile), and the position
        below which existing nodes need no reconcile). Handles that can attach nowhere
        go to `out` now."""
        return (), None, n

    def adopt(self, nd, incoming, keep, out: array) -> None:
        """Give a new node its value from `incoming`; unusable handles go to `out`."""
        raise NotImplementedError

    def reconcile(self, nd, incoming, prefix_len: int, keep, out: array) -> bool:
        """An existing node the insert covers: duplicates go to `out`. True when a value
        was attached where there was none (a tombstone healed, a checkpoint added)."""
        raise NotImplementedError


class PageComponent(Component):
    """One handle per page; `window` None means the whole prefix is needed.

    What a windowed component keeps of an insert: by default only the windows at its
    resume points (the end, the junction, the prompt's end); `keep_all` every page it
    brings; `keep_spare` every page too, but those no resume point needs are spares
    (`Node.spare`): eviction takes them before anything else, so they cost only room
    that would stand empty, and a later request that branches anywhere off the path
    still finds its window."""

    def __init__(self, window: int | None = None, keep_all: bool = False, keep_spare: bool = False) -> None:
        super().__init__()
        if window is not None and window <= 0:
            raise ValueError(f"{self.name}: window must be positive, got {window}")
        if keep_all and keep_spare:
            raise ValueError(f"{self.name}: keep_all and keep_spare are two retentions; choose one")
        self.window = window
        self.keep_all = keep_all
        self.keep_spare = keep_spare and window is not None and window > 1  # W = 1 reads no page before
        # the tokens before a boundary that the first query resumed there reads: W - 1
        self.reach = None if window is None else 0 - first_visible(0, window)
        self.plans = not self.structural  # FULL has no holes and no retention

    def window_start(self, b: int) -> int:
        """The first token of the first page reuse at boundary b needs."""
        if self.window is None:
            return 0
        lo = first_visible(b, self.window)
        return lo - lo % self.page if lo > 0 else 0

    def accepted(self, path, matched, host=True):
        ci = self.index
        if self.window is None:
            b = 0
            for nd in path:
                if nd.value[ci] is None and (not host or nd.host[ci] is None):
                    break
                b = nd.end if nd.end < matched else matched
            return [(0, b)]
        out: list[Interval] = [(0, 0)]
        run = -1  # where the present pages before the current node start (-1: none)
        reach, P = self.reach, self.page
        for nd in path:
            e = nd.end if nd.end < matched else matched
            if nd.value[ci] is None and (not host or nd.host[ci] is None):
                run = -1
                if reach:  # every boundary inside reads the node's own last page
                    continue
                lo = nd.start
            else:
                if run < 0:
                    run = nd.start
                # b is accepted once first_visible(b) >= run, i.e. b >= run + reach
                lo = nd.start if run == 0 else max(nd.start, page_ceil(run + reach, P))
            if lo > e:
                continue
            if lo <= out[-1][1]:
                out[-1] = (out[-1][0], e)
            else:
                out.append((lo, e))
        return out

    def accepts_end(self, nd):
        ci = self.index
        # the pages touching [lo, end) are those that end after lo
        lo = 0 if self.window is None else first_visible(nd.end, self.window)
        while nd.parent is not None and nd.end > lo:
            if nd.value[ci] is None and nd.host[ci] is None:
                return False
            nd = nd.parent
        return True

    def handles(self, path, b):
        ci = self.index
        out = array("i")
        lo = 0 if self.window is None else self.window_start(b)
        P = self.page
        for nd in path:
            if nd.end <= lo:
                continue
            v = nd.value[ci]
            out += v if nd.start >= lo else v[(lo - nd.start) // P:]
        return out

    def pin_from(self, nd):
        return 0 if self.window is None else self.window_start(nd.end)

    def plan(self, n, resume_points, incoming, prefix_len, out, running=False):
        # nodes split where the incoming pages start or stop being present, so that a
        # hole costs only its own span (below prefix_len the pages are the tree's own)
        edges = _presence_edges(incoming, self.page, prefix_len // self.page) \
            if incoming is not None else ()
        W = self.window
        if W is None or self.keep_all:
            return edges, None, prefix_len
        cuts, keep = [], []
        if not (running and self.keep_spare):  # a running end: its lock pins the window, and it moves on
            e = self.window_start(n)
            cuts, keep = [e], [(e, n)]
        for jn in resume_points:  # page-aligned positions later requests may resume at
            if jn <= 0:
                continue
            j = self.window_start(jn)
            cuts += (j, jn)
            keep.append((j, jn))
        return edges + tuple(cuts), keep, prefix_len

    @staticmethod
    def _kept(keep, s: int, e: int) -> bool:
        if keep is None:
            return True
        for lo, hi in keep:
            if lo <= s and e <= hi:
                return True
        return False

    def adopt(self, nd, incoming, keep, out):
        P = self.page
        v = incoming[nd.start // P: nd.end // P]
        if self.structural:
            nd.value[self.index] = v  # FULL comes whole (checked by the caller's length)
        elif _ABSENT in v.tobytes():
            _release(v, out)
        elif keep is None or self._kept(keep, nd.start, nd.end):
            nd.value[self.index] = v
        elif self.keep_spare:
            nd.value[self.index] = v
            nd.spare |= 1 << self.index
        else:
            _release(v, out)

    def reconcile(self, nd, incoming, prefix_len, keep, out):
        if nd.end <= prefix_len:
            return False
        P = self.page
        s = nd.start if nd.start > prefix_len else prefix_len
        v = incoming[s // P: nd.end // P]
        if nd.value[self.index] is None and s == nd.start and _all_present(v):
            if self._kept(keep, nd.start, nd.end):
                nd.value[self.index] = v  # heals a tombstone
                nd.spare &= ~(1 << self.index)
                return True
            if self.keep_spare:
                nd.value[self.index] = v  # heals it as a spare
                nd.spare |= 1 << self.index
                return True
        _release(v, out)
        return False


_ABSENT = b"\xff\xff\xff\xff"  # -1 as int32; no valid (non-negative) handle contains these bytes


def _presence_edges(v: array, P: int, start: int) -> tuple:
    """Token positions past page `start` where v's pages switch between present and
    absent (-1)."""
    tail = v[start:]
    b = tail.tobytes()
    if _ABSENT not in b:
        return ()
    # leading absent pages (a present handle never has a 0xff high byte, so the count
    # of stripped bytes // 4 is exact)
    k = (len(b) - len(b.lstrip(b"\xff"))) // 4
    if _ABSENT not in b[4 * k:]:
        return ((start + k) * P,) if 0 < k < len(tail) else ()
    edges = []
    prev = tail[0] >= 0
    for i in range(1, len(tail)):
        cur = tail[i] >= 0
        if cur != prev:
            edges.append((start + i) * P)
            prev = cur
    return tuple(edges)


def _all_present(v: array) -> bool:
    return _ABSENT not in v.tobytes()


def _release(v: array, out: array) -> None:
    if _ABSENT in v.tobytes():
        out.extend(h for h in v if h >= 0)
    else:
        out += v


class CheckpointComponent(Component):
    """One handle at a node's end: a snapshot valid only at exactly that boundary."""

    slices = False
    unit = "slots"
    checkpoint = True
    reach = 0

    def accepted(self, path, matched, host=True):
        ci = self.index
        out = [(0, 0)]
        for nd in path:
            if nd.end > matched:
                break
            if nd.value[ci] is not None or (host and nd.host[ci] is not None):
                out.append((nd.end, nd.end))
        return out

    def accepts_end(self, nd):
        return nd.value[self.index] is not None or nd.host[self.index] is not None

    def handles(self, path, b):
        if path and path[-1].end == b and path[-1].value[self.index] is not None:
            return path[-1].value[self.index]
        return array("i")

    def pin_from(self, nd):
        ci = self.index
        return -1 if nd.value[ci] is not None or nd.host[ci] is not None else None

    def plan(self, n, resume_points, incoming, prefix_len, out, running=False):
        if not incoming:
            return (), None, n
        P = self.page
        lo = n
        for p in incoming:
            if not (0 < p <= n and p % P == 0):
                break
            if p < lo:
                lo = p
        else:
            return incoming, None, lo - 1
        # some positions are unaligned, past the aligned end, or at 0: they come back now
        points = [p for p in incoming if 0 < p <= n and p % P == 0]
        out.extend(s for p, s in incoming.items() if not (0 < p <= n and p % P == 0))
        if not points:
            return (), None, n
        return points, None, min(points) - 1

    def adopt(self, nd, incoming, keep, out):
        slot = incoming.get(nd.end)
        if slot is not None:
            nd.value[self.index] = array("i", (slot,))

    def reconcile(self, nd, incoming, prefix_len, keep, out):
        slot = incoming.get(nd.end)
        if slot is None:
            return False
        if nd.value[self.index] is None:
            nd.value[self.index] = array("i", (slot,))
            return True
        out.append(slot)
        return False
