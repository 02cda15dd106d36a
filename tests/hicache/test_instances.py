"""Instances announcing themselves in one L3 namespace (hicache/instances.py): each sees
the others once their beat moves, a leftover record of a dead instance is never taken
for a live one and its slot is taken over once it has been still long enough, a stop
is seen at once, another namespace or secret is another fleet, and a server on a
node-local store that sees no one says so."""
from __future__ import annotations

import logging
import time

from uniradix.hicache.backends.memory import MemoryBackend
from uniradix.hicache.instances import Instances, slot_keys
from uniradix.hicache.keys import StorageNamespace

NS = StorageNamespace("model-a", page_size=4)


def inst(backend, n: int, ns=NS, **kw) -> Instances:
    return Instances(backend, ns, bytes([n]) * 16, info={"url": f"http://127.0.0.1:{9000 + n}"}, **kw)


def ids(i: Instances) -> list[str]:
    return sorted(o["instance"] for o in i.others())


def test_each_sees_the_others_once_their_beat_moves():
    store = MemoryBackend()
    a, b, c = (inst(store, n) for n in (1, 2, 3))
    for i in (a, b, c):
        i.beat()
    assert a.others() == []            # a first sight is not yet a live instance
    for i in (a, b, c):
        i.beat()
    assert ids(a) == [] and ids(b) == [a.id] and ids(c) == [a.id, b.id]   # seen to move since the first sight
    for i in (a, b, c):
        i.beat()
    assert ids(a) == [b.id, c.id] and ids(b) == [a.id, c.id]
    assert {a.slot, b.slot, c.slot} == {0, 1, 2}
    seen = {o["instance"]: o for o in a.others()}
    assert seen[b.id]["url"] == "http://127.0.0.1:9002" and seen[b.id]["pid"] > 0 and "host" in seen[b.id]


def test_a_stop_is_seen_at_once_and_silence_after_stale_s():
    store = MemoryBackend()
    a, b, c = inst(store, 1, stale_s=0.3), inst(store, 2), inst(store, 3, beat_s=0.05)
    for _ in range(3):
        for i in (a, b, c):
            i.beat()
    assert ids(a) == [b.id, c.id]
    b.close()                          # deletes its record
    a.beat()
    assert ids(a) == [c.id]
    time.sleep(0.4)                    # c hangs: its beat stops moving
    a.beat()
    assert ids(a) == []


def test_a_leftover_record_is_not_alive_and_its_slot_is_taken_over_once_still():
    store = MemoryBackend()
    dead = inst(store, 9, slots=2, beat_s=0.05)
    dead.beat()
    dead.beat()                        # then it dies without deleting its record (SIGKILL)
    live = inst(store, 1, slots=2, stale_s=0.3)
    live.beat()
    live.beat()
    assert live.slot == 1 and live.others() == []      # never seen to move: not alive
    late = inst(store, 2, slots=2, stale_s=0.3)
    late.beat()
    assert late.slot is None           # slot 0 is not yet known to be stale: nothing taken
    time.sleep(0.35)
    live.beat()
    late.beat()
    assert late.slot == 0              # the leftover, still for stale_s: taken over
    for _ in range(2):
        live.beat()
        late.beat()
    assert ids(live) == [late.id] and ids(late) == [live.id]


def test_other_namespaces_and_secrets_are_other_fleets():
    store = MemoryBackend()
    a = inst(store, 1)
    others = [inst(store, 2, ns=StorageNamespace("model-b", 4)), inst(store, 3, ns=StorageNamespace("model-a", 8)),
              Instances(store, NS, bytes([4]) * 16, secret=b"s3")]
    for _ in range(3):
        for i in (a, *others):
            i.beat()
    assert a.others() == [] and all(o.others() == [] for o in others)
    # a salt or a binding is the same fleet: one model's tenants share the announcements
    assert slot_keys(NS.with_salt("tenant")) == slot_keys(NS)
    assert slot_keys(NS, b"s3") != slot_keys(NS)


def test_alone_on_a_node_local_store_says_so(caplog):
    store = MemoryBackend()
    with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
        lone = inst(store, 1, beat_s=0.05, alone_hint="the file store at /x is node-local", alone_s=0.2)
        lone.start()
        time.sleep(0.5)
        lone.close()
    assert "no other instance has announced itself" in caplog.text and "/x is node-local" in caplog.text
    caplog.clear()
    store = MemoryBackend()
    with caplog.at_level(logging.WARNING, logger="uniradix.hicache"):
        peer = inst(store, 2, beat_s=0.05)
        one = inst(store, 1, beat_s=0.05, alone_hint="the file store at /x is node-local", alone_s=0.3)
        peer.start()
        one.start()
        time.sleep(0.6)
        assert ids(one) == [peer.id]
        one.close()
        peer.close()
    assert "no other instance" not in caplog.text


def test_a_slower_announcer_is_judged_by_its_own_interval():
    """A fleet mixing announce intervals: an instance that beats every 5 s is not gone
    to one that would call 0.3 s of silence stale, and its slot is not taken."""
    store = MemoryBackend()
    slow = inst(store, 9, slots=2, beat_s=5.0)
    fast = inst(store, 1, slots=2, beat_s=0.05, stale_s=0.3)
    slow.beat()
    fast.beat()
    slow.beat()
    fast.beat()
    assert ids(fast) == [slow.id]
    time.sleep(0.4)                    # longer than fast's stale_s, far shorter than 6 x 5 s
    late = inst(store, 2, slots=2, beat_s=0.05, stale_s=0.3)
    late.beat()
    fast.beat()
    assert ids(fast) == [slow.id] and late.slot is None   # slow's slot stays slow's
