"""A cache's work written to L3 serves a fresh cache with nothing in memory: the store
reports the deepest boundary every component accepts, a load is all or nothing, and a
request resuming from what was loaded computes exactly what the oracle computes."""
import random

import pytest
import torch

from uniradix.engine import Engine, Request, SamplingParams, build_cache
from uniradix.hicache import StorageNamespace
from uniradix.hicache.backends.file import FileBackend
from uniradix.hicache.store import L3Store
from uniradix.model import reference_forward
from uniradix.model.paged import PagedInput, paged_forward
from uniradix.tree.component import page_floor


def served(name, page, store_dir, n=45, out=6):
    """An engine serves one request; its cached work is written through to L3."""
    eng = Engine(name, page_size=page, max_total_tokens=1024)
    rng = random.Random(3)
    req = Request(input_ids=[rng.randrange(256) for _ in range(n)], sampling=SamplingParams(max_new_tokens=out))
    eng.run([req])
    ns = StorageNamespace.for_model(eng.cfg, page)
    store = L3Store(eng.cache, FileBackend(str(store_dir)), ns)
    wrote = store.save_cached(req.input_ids + req.output_ids[:-1])
    return eng, req, ns, wrote


def fresh(eng, page, store_dir, ns):
    cache, pools = build_cache(eng.cfg, page_size=page, max_total_tokens=1024, max_mamba_cache_size=8)
    return cache, pools, L3Store(cache, FileBackend(str(store_dir)), ns)


@pytest.mark.parametrize("name", ["tiny-hybrid", "jamba-like", "gemma3-like", "full-only"])
@pytest.mark.parametrize("page", [1, 4])
def test_a_fresh_cache_resumes_exactly_from_l3_alone(tmp_path, name, page):
    eng, req, ns, wrote = served(name, page, tmp_path)
    assert wrote > 0
    seq = req.input_ids + req.output_ids[:-1]   # what the first engine computed and cached
    nxt = seq + [7, 8, 9, 10, 11]               # the next turn
    cache, pools, store = fresh(eng, page, tmp_path, ns)
    b = store.hit(nxt)
    assert b == page_floor(len(seq), page)       # the end checkpoint (or all of FULL) is there
    P = page
    npages = -(-len(nxt) // P)
    full = pools["full"].alloc(npages)
    swa = pools["swa"].alloc(npages) if "swa" in pools else None
    slot = pools["mamba"].alloc(1)[0] if "mamba" in pools else None
    assert store.load(nxt, b, {"full": full, **({"swa": swa} if swa is not None else {})}, slot)
    logits = paged_forward(eng.cfg, eng.weights, pools, [PagedInput(nxt[b:], b, {"full": full, "swa": swa}, slot)])[0]
    ref = reference_forward(eng.cfg, eng.weights, nxt)
    assert (logits - ref[b:]).abs().max() < 1e-4
    # writing again adds nothing: only what the store lacks is written
    assert L3Store(eng.cache, FileBackend(str(tmp_path)), ns).save_cached(seq) == 0


def test_hit_needs_every_component(tmp_path):
    eng, req, ns, _ = served("tiny-hybrid", 4, tmp_path)
    seq = req.input_ids + req.output_ids[:-1]
    cache, pools, store = fresh(eng, 4, tmp_path, ns)
    b = store.hit(seq)
    assert b > 0
    # drop the checkpoint at b: the hit falls to a lower boundary that has one
    from uniradix.hicache import component_key, page_keys
    keys = page_keys(seq, ns)
    assert store.backend.delete(component_key(keys[b // 4 - 1], "mamba"))
    assert store.hit(seq) < b
    # another salt (tenant) sees nothing
    assert store.hit(seq, salt="tenant-2") == 0


def test_a_bad_object_fails_the_whole_load_and_is_counted(tmp_path):
    eng, req, ns, _ = served("tiny-hybrid", 4, tmp_path)
    seq = req.input_ids + req.output_ids[:-1]
    cache, pools, store = fresh(eng, 4, tmp_path, ns)
    b = store.hit(seq)
    from uniradix.hicache import page_keys
    victim = tmp_path / page_keys(seq, ns)[1]   # a FULL page in the middle
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    n = b // 4
    full, swa = pools["full"].alloc(n), pools["swa"].alloc(n)
    slot = pools["mamba"].alloc(1)[0]
    before = [t.clone() for t in pools["full"].handle_tensors()]
    assert not store.load(seq, b, {"full": full, "swa": swa}, slot)
    assert store.counters["corrupt"] == 1 and store.counters["failed_loads"] == 1
    assert all(torch.equal(a, t) for a, t in zip(before, pools["full"].handle_tensors()))  # nothing written


def test_a_newer_formats_object_is_a_miss_left_in_place(tmp_path):
    """A page a newer build wrote (a fleet being upgraded): this reader cannot use it,
    so the load misses, but the object is not taken for corrupt and deleted."""
    import struct
    eng, req, ns, _ = served("tiny-hybrid", 4, tmp_path)
    seq = req.input_ids + req.output_ids[:-1]
    cache, pools, store = fresh(eng, 4, tmp_path, ns)
    b = store.hit(seq)
    from uniradix.hicache import objects, page_keys
    victim = tmp_path / page_keys(seq, ns)[1]
    data = bytearray(victim.read_bytes())
    data[4:6] = struct.pack("<H", objects.VERSION + 1)
    victim.write_bytes(bytes(data))
    n = b // 4
    full, swa = pools["full"].alloc(n), pools["swa"].alloc(n)
    assert not store.load(seq, b, {"full": full, "swa": swa}, pools["mamba"].alloc(1)[0])
    assert store.counters["failed_loads"] == 1 and store.counters["corrupt"] == store.counters["deleted"] == 0
    assert victim.read_bytes() == bytes(data)


def test_a_witness_in_a_newer_format_is_not_replaced(tmp_path):
    import struct

    from uniradix.hicache import objects
    from uniradix.hicache.backends.file import FileBackend
    from uniradix.hicache.keys import StorageNamespace, witness_key
    from uniradix.hicache.storage import StorageUnavailable
    from uniradix.hicache.witness import Witness
    ns = StorageNamespace("m", 4)
    b = FileBackend(str(tmp_path))
    key = witness_key(ns)
    obj = bytearray(objects.pack_object(key, b"w-new", ns.seed()))
    obj[4:6] = struct.pack("<H", objects.VERSION + 1)
    b.batch_set([key], [bytes(obj)])
    with pytest.raises(StorageUnavailable, match="newer format"):
        Witness(b, ns, "w-old").allows()
    assert b.batch_get([key])[0] == bytes(obj)


def test_load_checks_its_arguments(tmp_path):
    eng, req, ns, _ = served("jamba-like", 4, tmp_path)
    cache, pools, store = fresh(eng, 4, tmp_path, ns)
    seq = req.input_ids
    with pytest.raises(ValueError, match="page-aligned"):
        store.load(seq, 6, {"full": pools["full"].alloc(2)}, 0)
    with pytest.raises(ValueError, match="state slot"):
        store.load(seq, 8, {"full": pools["full"].alloc(2)}, None)
    with pytest.raises(ValueError, match="page size"):
        L3Store(cache, store.backend, StorageNamespace("m", 2))
