"""Who else uses this L3 namespace. Only L3 is shared between servers, and only when
the store really is shared: a file store under a node-local path looks shared and is
not. So each server announces itself in its namespace and reads the others'
announcements, and what it sees (no one, or the fleet) is shown instead of silence.

The backend interface has no listing, so announcements live in a fixed set of slots
(SLOTS keys derived from the namespace, without its salt, and the objects' secret): a
server takes a free slot with set-if-absent and reads it back (of two servers racing,
one wins and the other takes the next), then rewrites its record every `beat_s`
seconds with a beat count that grows. A record whose count has not moved for
`stale_s` seconds (or six of its own announce intervals, which its record states,
whichever is longer), as this server watched it, is gone (no clocks compared across
machines); its slot may be taken over. A graceful stop deletes its own record.

Records are checked objects (objects.py) under the namespace's seed, keyed by the
secret when there is one: a writer without the secret cannot add instances. A record
read back is a stranger's all the same (any writer of the store, any build): every
field is checked (`check_record`: types, finite numbers, bounded texts and intervals)
and the fields it does not declare are dropped, so nothing a record says reaches a
response unchecked. A slot holding anything else (a record that fails its checks,
damaged bytes, a newer build's format) is no instance: the invalid ones are counted,
and the slot is taken over once its bytes have stayed as they are for `stale_s`, as a
silent record's is. All calls run on this module's own daemon thread, never on the
scheduler's, and a store that fails costs only the view of the fleet (counted, retried
at the next beat)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time

from ..config import ANNOUNCE_INTERVAL_MAX, finite_number
from .keys import StorageNamespace
from .log_limit import LogLimiter
from .objects import NEWER, CorruptObject, object_nbytes_at_most, pack_object, unpack_object
from .storage import StorageBackend, check_key

log = logging.getLogger("uniradix.hicache")

#: announcement slots per namespace: the largest fleet one namespace shows
SLOTS = 64
#: seconds between two announcements, and without a beat before a record is gone
BEAT_S, STALE_S = 5.0, 30.0
#: bytes an announcement may have
RECORD_MAX = 2048
#: seconds after which a server that has seen no other instance says so, where the
#: backend suspects why (a file store on a node-local filesystem)
ALONE_S = 60.0
#: characters a text field of a record may have
TEXT_MAX = 512


def _text(most: int):
    return lambda v: isinstance(v, str) and 0 < len(v) <= most and v.isprintable()


def _int_in(lo: int, hi: int):
    return lambda v: type(v) is int and lo <= v <= hi   # not a bool, not a float


def _number_in(lo: float, hi: float):
    return lambda v: finite_number(v) and lo <= v <= hi


#: every field a record may have, and its check (`instance` and `beat` required): an
#: interval above what any server may be configured with, a beat count or a start time
#: no clock reaches, a text too long to be a host name or a URL, is an invalid record
RECORD_FIELDS = {
    "instance": lambda v: isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v),
    "beat": _int_in(0, 2 ** 53),
    "beat_s": lambda v: finite_number(v) and 0 < v <= ANNOUNCE_INTERVAL_MAX,
    "host": _text(255),
    "pid": _int_in(0, 2 ** 32),
    "started": _number_in(0, 2 ** 33),
    "model": _text(TEXT_MAX),
    "url": _text(TEXT_MAX),
}
REQUIRED = ("instance", "beat")


def check_record(rec) -> dict | None:
    """`rec` (parsed from a slot) as a record this server may use and show: its declared
    fields, each checked (undeclared ones, a newer build's say, are dropped); None if it
    is not a JSON object, lacks a required field or has one that fails its check."""
    if not isinstance(rec, dict) or any(k not in rec for k in REQUIRED):
        return None
    out = {}
    for name, ok in RECORD_FIELDS.items():
        if name in rec:
            if not ok(rec[name]):
                return None
            out[name] = rec[name]
    return out


class Unusable:
    """A slot that holds something other than a valid record: `digest` of its bytes
    (the slot is taken over once they stay the same for stale_s), `newer` when it is a
    newer build's (not counted invalid: that build may read it)."""

    def __init__(self, data: bytes, newer: bool = False) -> None:
        self.digest = hashlib.sha256(data).digest()
        self.newer = newer


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def fleet_namespace(ns: StorageNamespace) -> StorageNamespace:
    """`ns` without its salt or binding: every tenant, every weight binding of a model's
    name meets in one fleet."""
    return StorageNamespace(ns.model, ns.page_size, ns.rank, weights=ns.weights)


def slot_keys(ns: StorageNamespace, secret: bytes | None = None, slots: int = SLOTS) -> list[str]:
    """Where a namespace's announcements live: one key per slot, from its fleet
    namespace and a digest of the secret."""
    h = hashlib.sha256(b"uniradix-instances-v1\0" + fleet_namespace(ns).seed())
    if secret:
        h.update(hashlib.blake2b(secret, digest_size=16, person=b"urx-l3-instances").digest())
    base = h.digest()
    return [check_key(f"{hashlib.sha256(base + i.to_bytes(2, 'little')).hexdigest()}.instance")
            for i in range(slots)]


class Instances:
    """backend: the store; namespace: the storage tier's (its salt and binding are left
    out); instance: this server's 16-byte id (the writer its objects name); witness:
    the tier's Witness (no announcement in a namespace refused to this server); info:
    what the record says of this server beside its id, host, pid and start time;
    alone_hint: why no other instance may ever show up (the backend's sharing_hint):
    said, with it, once `alone_s` seconds have passed without one."""

    def __init__(self, backend: StorageBackend, namespace: StorageNamespace, instance: bytes,
                 secret: bytes | None = None, witness=None, info: dict | None = None,
                 beat_s: float = BEAT_S, stale_s: float = STALE_S, slots: int = SLOTS,
                 alone_hint: str | None = None, alone_s: float = ALONE_S) -> None:
        self.backend = backend
        self.keys = slot_keys(namespace, secret, slots)
        self.seed = fleet_namespace(namespace).seed()
        self.secret = secret
        self.witness = witness
        self.id = instance.hex()
        self.record = {"instance": self.id, "host": socket.gethostname(), "pid": os.getpid(),
                       "started": round(time.time(), 3), **(info or {})}
        self.beat_s, self.stale_s = beat_s, stale_s
        self.alone_hint, self.alone_s = alone_hint, alone_s
        self.ever_seen = 0   # other instances seen alive since the start
        self.slot: int | None = None
        self.beats = 0
        self.errors = 0
        self.invalid = 0     # records read that failed their checks (each counted once, as first seen)
        self._watched: dict[str, list] = {}   # id -> [record, beat count, when it last moved, moved ever]
        self._unusable: dict[int, tuple] = {}  # slot -> (its bytes' digest, since when they are as they are)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warn = LogLimiter(log, "L3 instances")
        backend.expect_values_up_to(object_nbytes_at_most(RECORD_MAX))

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        """Announce now and every beat_s seconds, on a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="uniradix-l3-instances", daemon=True)
            self._thread.start()

    def describe(self, **info) -> None:
        """Add to what the record says (the server's address once it is bound, say)."""
        with self._lock:
            self.record.update(info)

    def others(self) -> list[dict]:
        """The other instances alive now (their beat moved within stale_s, as watched
        from here): their records, with `seen_s` (seconds since it last moved)."""
        now = time.monotonic()
        with self._lock:
            return [dict(rec, seen_s=round(now - moved, 1)) for rec, _, moved, alive in self._watched.values()
                    if alive and now - moved < self._stale_after(rec)]

    def stats(self) -> dict:
        return {"this_instance": self.id, "slot": self.slot, "beats": self.beats, "errors": self.errors,
                "invalid_records": self.invalid, "others": self.others()}

    def close(self, timeout: float = 2.0) -> None:
        """Stop announcing and delete this server's record (best effort, within `timeout`:
        the others see it gone at once instead of after stale_s)."""
        self._stop.set()
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                return  # stuck in the store: the record goes stale by itself
        if self.slot is not None:
            try:
                if self._read(self.slot).get("instance") == self.id:
                    self.backend.delete(self.keys[self.slot])
            except Exception as e:   # the others see it go stale instead
                self._warn.failure("records left behind", "could not delete this instance's record: %s", e)
        self._warn.flush()

    # ------------------------------------------------------------------ its thread
    def _loop(self) -> None:
        alone_at = time.monotonic() + self.alone_s
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception as e:  # the store failed: only the view of the fleet waits
                self.errors += 1
                self._warn.failure("announcements failed", "announcing this instance failed: %s", e)
            if alone_at is not None and time.monotonic() >= alone_at:
                alone_at = None
                if self.alone_hint and not self.ever_seen:
                    log.warning("L3: no other instance has announced itself in this namespace in %.0f s, and %s: "
                                "L3 is shared with no one (every server computes what the others have)",
                                self.alone_s, self.alone_hint)
            self._stop.wait(self.beat_s)

    def beat(self) -> None:
        """Read every slot, note who moved, then write this server's record (taking a
        slot first if it has none, or lost it)."""
        if self.witness is not None and not self.witness.allows():
            return   # another model's namespace: not ours to announce in
        slots = self._read_all()
        now = time.monotonic()
        self._note_unusable(slots, now)
        records = [rec if isinstance(rec, dict) else None for rec in slots]
        with self._lock:
            for rec in records:
                if rec is None or rec.get("instance") == self.id:
                    continue
                w = self._watched.get(rec["instance"])
                if w is None:   # first sight: alive once its beat moves (a leftover never does)
                    self._watched[rec["instance"]] = [rec, rec.get("beat"), now, False]
                elif w[1] != rec.get("beat"):
                    self._watched[rec["instance"]] = [rec, rec.get("beat"), now, True]
                    self.ever_seen += not w[3]
            present = {rec["instance"] for rec in records if rec is not None}
            for iid in [i for i in self._watched if i not in present]:
                del self._watched[iid]   # its record was deleted (a graceful stop) or replaced: gone
        mine = self.slot is not None and (records[self.slot] or {}).get("instance") == self.id
        if not mine:
            self.slot = self._take(slots, now)
            if self.slot is None:
                self._warn.failure("no free slot", "all %d announcement slots of this L3 namespace are "
                                   "taken by live instances: this one is not announced", len(self.keys))
                return
        self.beats += 1
        self.backend.batch_set([self.keys[self.slot]], [self._pack(self.slot)])

    def _note_unusable(self, slots: list, now: float) -> None:
        """Remember since when each slot holds the unusable bytes it holds; count each
        invalid record once, when first seen."""
        for i, rec in enumerate(slots):
            if not isinstance(rec, Unusable):
                self._unusable.pop(i, None)
                continue
            seen = self._unusable.get(i)
            if seen is None or seen[0] != rec.digest:
                self._unusable[i] = (rec.digest, now)
                self.invalid += not rec.newer

    def _take(self, slots: list, now: float) -> int | None:
        """A slot for this server: a free one, else one whose record is stale, or whose
        unusable bytes have stayed as they are for stale_s."""
        with self._lock:
            live = {i for i, (rec, _, moved, _) in self._watched.items() if now - moved < self._stale_after(rec)}
        for i, rec in enumerate(slots):
            if isinstance(rec, Unusable):
                if now - self._unusable[i][1] < self.stale_s:
                    continue   # not still long enough to call it gone
                self.backend.delete(self.keys[i])
                rec = None
            if rec is not None and rec.get("instance") == self.id:
                return i   # its own record (a take whose read-back failed): still its slot
            if rec is not None and rec.get("instance") in live:
                continue
            if rec is not None:   # a stale record, or one unseen long enough: take its place
                w = self._watched.get(rec.get("instance"))
                if w is None or now - w[2] < self._stale_after(rec):
                    continue   # not watched long enough to call it gone
                self.backend.delete(self.keys[i])
            self.beats += 1
            if self.backend.set_if_absent(self.keys[i], self._pack(i)) and \
                    self._read(i).get("instance") == self.id:
                return i
            self.beats -= 1
        return None

    def _stale_after(self, rec: dict) -> float:
        """Seconds without a beat after which `rec`'s instance is gone: stale_s, or six
        of its own intervals when it announces more slowly (a fleet mixing intervals)."""
        theirs = rec.get("beat_s")
        return max(self.stale_s, 6 * theirs) if isinstance(theirs, (int, float)) and theirs > 0 else self.stale_s

    def _pack(self, i: int) -> bytes:
        with self._lock:
            rec = dict(self.record, beat=self.beats, beat_s=self.beat_s)
        bad = [k for k, ok in RECORD_FIELDS.items() if k in rec and not ok(rec[k])]
        if bad:   # the others would take it for a hostile record
            raise ValueError(f"this instance's record fails its own checks: {', '.join(bad)}")
        data = json.dumps(rec, sort_keys=True).encode()
        if len(data) > RECORD_MAX:
            raise ValueError(f"an instance record is {len(data)} bytes, at most {RECORD_MAX}")
        return pack_object(self.keys[i], data, self.seed, self.secret)

    def _read_all(self) -> list:
        """Each slot: its checked record, None (empty) or Unusable."""
        return [self._decode(d, i) for i, d in enumerate(self.backend.batch_get(self.keys))]

    def _read(self, i: int) -> dict:
        rec = self._decode(self.backend.batch_get([self.keys[i]])[0], i)
        return rec if isinstance(rec, dict) else {}

    def _decode(self, data, i: int) -> "dict | Unusable | None":
        if data is None:
            return None
        if len(data) > object_nbytes_at_most(RECORD_MAX):   # no record of ours is this large
            return Unusable(bytes(data))
        try:
            rec = check_record(json.loads(unpack_object(data, self.keys[i], self.seed, self.secret),
                                          parse_constant=_no_constant))
        except CorruptObject as e:   # another secret, damaged, a newer build's
            return Unusable(data, newer=e.kind == NEWER)
        except (ValueError, RecursionError):   # not JSON (NaN and Infinity are not), or nested past parsing
            return Unusable(data)
        return Unusable(data) if rec is None else rec
