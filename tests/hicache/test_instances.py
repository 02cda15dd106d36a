"""Instances announcing themselves in one L3 namespace (hicache/instances.py): each sees
the others once their beat moves, a leftover record of a dead instance is never taken
for a live one and its slot is taken over once it has been still long enough, a stop
is seen at once, another namespace or secret is another fleet, and a server on a
node-local store that sees no one says so."""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
from pathlib import Path

import pytest

from uniradix.hicache.backends.memory import MemoryBackend
from uniradix.hicache.instances import SLOTS, Instances, check_record, fleet_namespace, slot_keys
from uniradix.hicache.keys import StorageNamespace
from uniradix.hicache.objects import pack_object

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


# --------------------------------------------------------------------------- hostile records
# The namespace is shared: anyone who can write the store can write a slot. A record is
# checked field by field; one that fails is no instance (counted), its slot is taken
# over like a silent one's, and nothing it says reaches what this server shows.

def plant(store, slot: int, payload, ns=NS, slots: int = SLOTS) -> None:
    """Write `payload` (a dict as JSON, or raw bytes) into announcement slot `slot`."""
    key = slot_keys(ns, None, slots)[slot]
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    store.batch_set([key], [pack_object(key, data, fleet_namespace(ns).seed())])


def hostile_records(beat: int) -> list:
    """Records that must not count as instances, at beat count `beat` (re-planted with a
    higher one, the valid-looking ones move as a live instance's would)."""
    iid = lambda n: f"{n:032x}"   # noqa: E731
    ok = {"beat": beat, "beat_s": 1.0, "host": "h", "pid": 1, "started": 1.7e9, "url": "http://127.0.0.1:1"}
    return [
        {**ok, "instance": iid(1), "beat_s": float("inf")},               # Infinity
        {**ok, "instance": iid(2), "beat_s": float("nan")},               # NaN
        {**ok, "instance": iid(3), "beat_s": 1e12},                       # an interval no server has
        {**ok, "instance": iid(4), "beat": float("nan")},                 # a beat that always "moves"
        {**ok, "instance": iid(5), "beat": "x" * 100},                    # wrong types
        {**ok, "instance": iid(6), "pid": True},
        {**ok, "instance": iid(7), "started": -float("inf")},
        {**ok, "instance": 12345},
        {**ok, "instance": "not hex"},
        {**ok, "instance": iid(8), "host": "h" * 1500},                   # a huge string
        {**ok, "instance": iid(9), "url": {"a": [[{"b": [1, [2, [3]]]}]]}},  # nested junk
        {**ok, "instance": iid(10), "model": "m\x1b[2J"},                 # control characters
        {**ok, "instance": iid(11), "beat": 10 ** 30},
        ('{"instance": "%s", "beat": %d, "beat_s": 1e400}' % (iid(12), beat)).encode(),  # Infinity by overflow
        ('{"instance": "%s", "beat": %d, "x": %s}' % (iid(13), beat, "[" * 5000 + "]" * 5000)).encode(),
        ('{"instance": "%s", "beat": %d, "junk": "%s"}' % (iid(14), beat, "j" * 200_000)).encode(),  # too big
        b"\xff\xfe not JSON",
        [1, 2, 3],
    ]


def strict_json(obj) -> str:
    return json.dumps(obj, allow_nan=False)


def test_hostile_records_are_not_instances_and_nothing_they_say_is_shown():
    store = MemoryBackend()
    good = inst(store, 2)
    me = inst(store, 1)
    bad = hostile_records(1)
    for beat in (1, 2, 3):                  # every record moves, as a live instance's does
        for slot, rec in enumerate(hostile_records(beat), start=10):
            plant(store, slot, rec)
        good.beat()
        me.beat()
    assert ids(me) == [good.id]             # the one valid record, and only it
    stats = me.stats()
    strict_json(stats)                      # what /get_server_info shows: JSON, no NaN or Infinity
    assert set(stats["others"][0]) <= {"instance", "beat", "beat_s", "host", "pid", "started", "model", "url",
                                       "seen_s"}
    # each counted once, when first seen: a record whose bytes changed is another one
    distinct = {(i, json.dumps(r) if not isinstance(r, bytes) else r) for beat in (1, 2, 3)
                for i, r in enumerate(hostile_records(beat))}
    assert stats["invalid_records"] == len(distinct) > len(bad)
    assert me.slot is not None


def test_an_unknown_field_is_dropped_and_the_record_kept():
    store = MemoryBackend()
    me = inst(store, 1)
    for beat in (1, 2, 3):
        plant(store, 5, {"instance": "ab" * 16, "beat": beat, "beat_s": 1.0, "newer": {"deep": [[1, {"x": "y" * 300}]]}})
        me.beat()
    assert me.others() and all(set(o) == {"instance", "beat", "beat_s", "seen_s"} for o in me.others())
    strict_json(me.stats())


def test_hostile_records_in_every_slot_do_not_keep_a_new_server_from_one():
    """62 records claiming a huge interval left a new server without a slot: invalid
    records are taken over after stale_s, as silent ones are."""
    store = MemoryBackend()
    bad = hostile_records(1)
    for slot in range(SLOTS):   # an infinite interval, one of 10^12 s, a NaN beat (always "moving")
        plant(store, slot, bad[(0, 2, 3)[slot % 3]])
    new = inst(store, 1, stale_s=0.3)
    new.beat()
    assert new.slot is None                 # not yet still for stale_s: nothing taken
    time.sleep(0.4)
    new.beat()
    assert new.slot is not None
    other = inst(store, 2, stale_s=0.3)     # and the next server too
    other.beat()
    time.sleep(0.4)
    other.beat()
    assert other.slot not in (None, new.slot)
    for _ in range(2):
        new.beat()
        other.beat()
    assert ids(new) == [other.id] and ids(other) == [new.id]


def test_a_record_that_claims_a_longer_interval_than_any_server_may_is_invalid():
    from uniradix.config import ANNOUNCE_INTERVAL_MAX, StorageConfig
    assert check_record({"instance": "ab" * 16, "beat": 1, "beat_s": ANNOUNCE_INTERVAL_MAX}) is not None
    assert check_record({"instance": "ab" * 16, "beat": 1, "beat_s": ANNOUNCE_INTERVAL_MAX * 1.01}) is None
    # and no server may be configured with one
    with pytest.raises(ValueError, match="announce_interval"):
        StorageConfig(hicache_storage_backend="file", announce_interval=ANNOUNCE_INTERVAL_MAX * 2)


def test_server_info_stays_200_with_hostile_records_in_its_namespace(tmp_path):
    """/get_server_info and /server_info (which SGLang's gateway reads when it adds a
    worker), the dashboard's data and /metrics answer while hostile records keep moving
    in every other slot; the server takes a slot and counts them."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
    from server_proc import ServerProc
    from uniradix.hicache.backends.file import FileBackend
    ns = StorageNamespace.for_model("hostile-fleet", 4, 0)
    store = FileBackend(str(tmp_path))
    for slot, rec in enumerate(hostile_records(1)):
        plant(store, slot, rec, ns)
    stop = threading.Event()

    def keep_moving():                      # as a live writer would: a new beat every 0.1 s
        beat = 2
        while not stop.wait(0.1):
            for slot, rec in enumerate(hostile_records(beat)):
                plant(store, slot, rec, ns)
            beat += 1

    writer = threading.Thread(target=keep_moving, daemon=True)
    s = ServerProc("--page-size", "4", "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
                   json.dumps({"path": str(tmp_path), "model_fingerprint": "hostile-fleet", "announce_interval": 0.2}))
    writer.start()
    try:
        deadline = time.monotonic() + 60
        while True:                         # its announcer has read every slot, moving ones included
            for path in ("/get_server_info", "/server_info"):
                status, info, _ = s.get(path)
                assert status == 200, info
            fleet = info["l3_instances"]
            # announced, after many reads of every slot, each seeing the records moved
            if fleet["slot"] is not None and fleet["beats"] >= 10 and fleet["invalid_records"] > 20:
                break
            assert time.monotonic() < deadline, fleet
            time.sleep(0.2)
        assert fleet["others"] == []
        status, data, _ = s.get("/dashboard/data")
        assert status == 200
        status, text, _ = s.get("/metrics")
        assert status == 200
        counted = [line for line in text.splitlines()
                   if line.startswith("uniradix_storage_instance_records_invalid_total ")]
        assert counted and float(counted[0].split()[1]) >= fleet["invalid_records"]
    finally:
        stop.set()
        writer.join(10)
        assert s.stop() == 0, "".join(s.lines[-30:])
