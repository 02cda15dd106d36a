"""Places in line for requests refused at a full queue.

A full queue (--max-queued-requests) refuses at once with 503 and Retry-After, as
SGLang's does. Without memory of who was refused, the place that frees next goes to
whichever request asks first, so a client that keeps retrying can lose every race to
newer ones and never be served. Here a refused request keeps its place in line, known
by what it asks (a retry is the same request again): the places that free go to the
refused requests in the order they were first refused, and a new request queues only
where the refused ones leave room for it.

Two bounds keep a client that gave up from costing much: its place is kept for KEEP_S
seconds after its last refusal, and the line holds at most the queue's own places (or
what the first in line needs, a batch larger than the queue), never the running batch's
free places, which any request may take: a server with room to run never refuses."""
from __future__ import annotations

import time
from collections import OrderedDict

#: seconds a refused request keeps its place without asking again: several times the
#: Retry-After the refusal gives (1 s), and more than the backoff of common clients
KEEP_S = 30.0
#: refused requests remembered at most (each holds a 16-byte key and two numbers)
MAX_ENTRIES = 4096
#: seconds between two sweeps of the places whose client stopped asking
SWEEP_S = 1.0


class Waitlist:
    """Refused requests by the order of their first refusal: key -> [places it needs,
    when it was last refused]. Not thread-safe: the runner calls it under its lock."""

    def __init__(self, keep_s: float = KEEP_S, max_entries: int = MAX_ENTRIES, clock=time.monotonic) -> None:
        self.keep_s = keep_s
        self.max_entries = max_entries
        self.clock = clock
        self._line: OrderedDict[bytes, list] = OrderedDict()
        self._places = 0        # places the whole line needs
        self._swept = float("-inf")

    def __len__(self) -> int:
        return len(self._line)

    def __contains__(self, key) -> bool:
        return key in self._line

    def order(self) -> list:
        """The keys in line, first refused first."""
        return list(self._line)

    def admit(self, key, n: int, room: int, limit: int) -> bool:
        """Whether a request for `n` places may queue now, `room` places being left
        (`limit`, the queue's bound, plus the batch's free places, less what is queued
        or handed over). The places the refused requests ahead of it need are kept for
        them, up to the queue's bound (or to what the first in line needs); a request
        refused keeps its place in line, or takes the last one (`key` None: refused,
        not remembered)."""
        now = self.clock()
        self._sweep(now)
        first = next(iter(self._line.values()), None)
        held = limit if first is None else max(limit, first[0])
        if min(self._ahead(key, held), held) + n <= room:
            self._leave(key)
            return True
        if key is not None:
            place = self._line.get(key)
            if place is not None:
                place[1] = now
            elif len(self._line) < self.max_entries:
                self._line[key] = [n, now]
                self._places += n
        return False

    def _ahead(self, key, held: int) -> int:
        """Places the requests ahead of `key` need (all of the line for a request not
        in it), counted up to `held`."""
        if key not in self._line:
            return self._places
        ahead = 0
        for k, (n, _) in self._line.items():
            if k == key or ahead >= held:
                break
            ahead += n
        return ahead

    def _leave(self, key) -> None:
        place = self._line.pop(key, None)
        if place is not None:
            self._places -= place[0]

    def _sweep(self, now: float) -> None:
        """Drop the places of requests not refused again for keep_s (their clients
        stopped asking), at most once every SWEEP_S."""
        if now - self._swept < SWEEP_S:
            return
        self._swept = now
        for k in [k for k, (_, last) in self._line.items() if now - last > self.keep_s]:
            self._leave(k)
