"""The witness of a namespace's weights: engines that name their model themselves
(model_fingerprint) but hold other weights must never read each other's L3 data; the
same weights in another layout still share; two engines starting at once agree on one
witness; a store that is down at start delays nothing; a store later claimed by other
weights is noticed."""
import json
import logging
import random
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
from engine_checks import check_exact, greedy  # noqa: E402

from uniradix.engine import Engine  # noqa: E402
from uniradix.hicache import StorageNamespace, StorageUnavailable  # noqa: E402
from uniradix.hicache.backends.file import FileBackend  # noqa: E402
from uniradix.hicache.keys import witness_key  # noqa: E402
from uniradix.hicache.objects import pack_object  # noqa: E402
from uniradix.hicache.witness import Witness  # noqa: E402
from uniradix.model import init_weights, preset, save_weights  # noqa: E402
from uniradix.tree.component import page_floor  # noqa: E402

CFG = preset("tiny-hybrid")
NAME = "acme/tiny@v1"


def named_engine(store, weights, **kw):
    return Engine(CFG, weights=weights, page_size=4, max_total_tokens=2048, storage=store, prefetch_threshold=1,
                  model_fingerprint=NAME, **kw)


def first_turn(eng, seed=1):
    rng = random.Random(seed)
    r = greedy([rng.randrange(256) for _ in range(60)], 5)
    eng.run([r])
    check_exact(eng, r)
    return r.input_ids + r.output_ids + [rng.randrange(256) for _ in range(7)]


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete"])
def test_same_name_other_weights_reads_nothing_and_answers_right(tmp_path, policy, caplog):
    """The issue's case: two servers given one model_fingerprint and different weights.
    The second finds the first's witness, refuses L3 (no read, no write), says so once
    with the namespace and both witnesses, counts it, and answers as a cache-off engine."""
    mine, other = init_weights(CFG), init_weights(CFG.with_(seed=9))
    a = named_engine(FileBackend(str(tmp_path)), mine)
    nxt = first_turn(a)
    assert a.stats()["storage_saved_objects"] > 0 and a.stats()["storage_refused"] == 0
    b = named_engine(FileBackend(str(tmp_path)), other, hicache_storage_prefetch_policy=policy)
    with caplog.at_level(logging.ERROR, logger="uniradix.hicache"):
        rs = [greedy(nxt, 6), greedy(nxt[:40] + [1, 2, 3], 4)]
        b.run(rs)
    off = Engine(CFG, weights=other, page_size=4, max_total_tokens=2048, disable_radix_cache=True)
    for r in rs:
        check_exact(b, r)
        assert r.metrics.storage_tokens == 0
        assert r.output_ids == off.generate(r.input_ids, max_new_tokens=len(r.output_ids)).output_ids
    s = b.stats()
    assert s["storage_refused"] == 1 and s["storage_witness_mismatch"] == 1
    assert s["storage_loads"] == 0 and s["storage_saved_objects"] == 0
    assert s["storage"]["witness"]["state"] == "refused"
    from uniradix.redact import redact
    shown = redact(json.dumps(s["storage"]))  # as `uniradix run --json` prints it: the witness is no secret
    assert s["storage"]["witness"]["stored_as"] in shown and s["storage"]["witness"]["theirs"] in shown
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert NAME in errors[0] and a.storage.witness.mine in errors[0] and b.storage.witness.mine in errors[0]
    # the first engine still trusts its namespace and reuses from it
    c = named_engine(FileBackend(str(tmp_path)), mine)
    r = greedy(nxt, 3)
    c.run([r])
    check_exact(c, r)
    assert r.metrics.storage_tokens > 0 and c.stats()["storage_refused"] == 0
    for e in (a, b, c):
        e.close()


def test_same_weights_in_another_layout_still_share(tmp_path):
    """The override stays useful: the same tensors from a safetensors file, or handed
    in memory as a copy, give the same witness and share the namespace."""
    mine = init_weights(CFG)
    path = tmp_path / "w.safetensors"
    save_weights(mine, str(path))
    store = tmp_path / "l3"
    a = named_engine(FileBackend(str(store)), str(path))
    nxt = first_turn(a, seed=2)
    copy = {k: v for k, v in mine.items()}
    copy["layers"] = [{n: t.clone() for n, t in lw.items()} for lw in mine["layers"]]
    b = named_engine(FileBackend(str(store)), copy)
    r = greedy(nxt, 4)
    b.run([r])
    check_exact(b, r)
    assert r.metrics.storage_tokens == page_floor(len(nxt) - 8, 4)
    assert b.stats()["storage_refused"] == 0 and b.stats()["storage"]["witness"]["state"] == "trusted"


def test_same_name_weights_that_differ_where_a_sample_does_not_look(tmp_path):
    """Under a fleet's own name the witness reads every byte: weights that differ in one
    element no sampled witness reads (an edited embedding row) are another model."""
    from uniradix.model import weights_witness
    mine = init_weights(CFG)
    other = init_weights(CFG)
    other["embed"][7, 1:] += 0.5  # row 7: token 7; no sample reads past its first element
    assert weights_witness(other) == weights_witness(mine)  # the cheap witness cannot tell
    a = named_engine(FileBackend(str(tmp_path)), mine)
    prompt = [7, 7] + first_turn(a)
    a.run([greedy(prompt, 3)])
    b = named_engine(FileBackend(str(tmp_path)), other)
    r = greedy(prompt, 4)
    b.run([r])
    assert r.metrics.storage_tokens == 0 and b.stats()["storage_refused"] == 1
    off = Engine(CFG, weights=other, page_size=4, max_total_tokens=2048, disable_radix_cache=True)
    assert r.output_ids == off.generate(r.input_ids, max_new_tokens=4).output_ids


def test_same_name_same_weights_other_config_reads_nothing(tmp_path):
    """Under a fleet's own name, one checkpoint's tensors with another config (a
    narrower sliding window): other KV, so the witness (which binds the model's
    computation) refuses the second."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model" / "hf"))
    import shutil
    from harness import make_tiny
    a_dir = make_tiny("gemma3", str(tmp_path / "a"))
    b_dir = tmp_path / "b"
    shutil.copytree(a_dir, b_dir)
    cfg = json.loads((b_dir / "config.json").read_text())
    cfg["sliding_window"] = max(2, cfg["sliding_window"] // 4)
    (b_dir / "config.json").write_text(json.dumps(cfg))
    store = str(tmp_path / "l3")

    def eng(path, **kw):
        return Engine(str(path), page_size=4, max_total_tokens=2048, storage=FileBackend(store), prefetch_threshold=1,
                      model_fingerprint="acme/gemma3-tiny", **kw)

    rng = random.Random(5)
    ids = [rng.randrange(8, 500) for _ in range(60)]
    eng(a_dir).run([greedy(ids, 3)])
    b = eng(b_dir)
    assert b.storage.witness.mine != eng(a_dir).storage.witness.mine
    r = greedy(ids + [9, 10, 11], 4)
    b.run([r])
    assert r.metrics.storage_tokens == 0 and b.stats()["storage_refused"] == 1
    off = Engine(str(b_dir), page_size=4, max_total_tokens=2048, disable_radix_cache=True)
    assert r.output_ids == off.generate(r.input_ids, max_new_tokens=4).output_ids


def test_a_sharded_checkpoint_shares_with_the_single_file_one(tmp_path):
    """A Hugging Face checkpoint saved whole and the same one saved as shards: one
    witness, so under one model_fingerprint the second reuses the first's L3 data."""
    pytest.importorskip("transformers")
    hf = str(Path(__file__).resolve().parents[1] / "model" / "hf")
    sys.path.insert(0, hf)
    from harness import make_tiny
    from transformers import AutoModelForCausalLM

    whole = make_tiny("qwen3", str(tmp_path / "whole"))
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(whole).save_pretrained(str(sharded), max_shard_size="100KB")
    import shutil
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(whole) / f).exists():
            shutil.copy(Path(whole) / f, sharded / f)
    assert (sharded / "model.safetensors.index.json").exists()
    store = str(tmp_path / "l3")

    def eng(path):
        return Engine(path, page_size=4, max_total_tokens=2048, storage=FileBackend(store), prefetch_threshold=1,
                      model_fingerprint="acme/qwen3-tiny")

    a = eng(whole)
    rng = random.Random(3)
    r1 = greedy([rng.randrange(8, 500) for _ in range(48)], 4)
    a.run([r1])
    b = eng(str(sharded))
    assert b.storage.witness.mine == a.storage.witness.mine
    r = greedy(r1.input_ids + r1.output_ids + [9, 10, 11], 3)
    b.run([r])
    assert r.metrics.storage_tokens > 0 and b.stats()["storage_refused"] == 0
    assert r.output_ids == a.generate(r.input_ids, max_new_tokens=3).output_ids


def test_without_the_override_the_witness_is_checked_too(tmp_path):
    """Cheap and harmless: an engine named by its weights' digest writes and agrees
    with its witness like any other."""
    a = Engine("tiny-hybrid", page_size=4, max_total_tokens=2048, storage=FileBackend(str(tmp_path)),
               prefetch_threshold=1)
    nxt = first_turn(a, seed=4)
    assert a.stats()["storage"]["witness"]["state"] == "trusted"
    assert (tmp_path / a.storage.witness.key).is_file()
    b = Engine("tiny-hybrid", page_size=4, max_total_tokens=2048, storage=FileBackend(str(tmp_path)),
               prefetch_threshold=1)
    r = greedy(nxt, 3)
    b.run([r])
    assert r.metrics.storage_tokens > 0


class Flaky(FileBackend):
    """A file store that is unreachable while `down` is set."""

    down = True

    def _gate(self):
        if self.down:
            raise StorageUnavailable("file backend: down for the test")

    def batch_get(self, keys):
        self._gate()
        return super().batch_get(keys)

    def batch_exists(self, keys):
        self._gate()
        return super().batch_exists(keys)

    def batch_contains(self, keys):
        self._gate()
        return super().batch_contains(keys)


def test_a_store_down_at_start_is_checked_when_it_answers(tmp_path):
    """Start-up asks nothing of the store; while it is down every read and write fails
    (counted) and nothing is trusted; once it answers the witness is written and L3 works."""
    store = Flaky(str(tmp_path))
    a = named_engine(store, init_weights(CFG))   # no store call here
    nxt = first_turn(a, seed=5)
    s = a.stats()
    assert s["storage_errors"] >= 1 and s["storage_saved_objects"] == 0
    assert s["storage"]["witness"]["state"] == "unchecked" and s["storage_refused"] == 0
    store.down = False
    r = greedy(nxt, 3)
    a.run([r])
    assert a.stats()["storage_saved_objects"] > 0 and a.storage.witness.state == "trusted"
    b = named_engine(FileBackend(str(tmp_path)), init_weights(CFG))
    r2 = greedy(nxt + [4, 4, 4, 4], 3)
    b.run([r2])
    check_exact(b, r2)
    assert r2.metrics.storage_tokens > 0


@pytest.mark.parametrize("atomic", [True, False])
def test_engines_starting_at_once_agree_on_one_witness(tmp_path, atomic):
    """Eight engines with two sets of weights race for an empty namespace: exactly the
    ones whose weights match the stored witness trust it, whatever the interleaving.
    A backend without an atomic set-if-absent (the base class's default: a check, then
    a set) can let two writers each read their own back; the next check (every
    RECHECK_S seconds; here at once) settles it the same way."""
    from uniradix.hicache.storage import StorageBackend
    ns = StorageNamespace.for_model(NAME, 4)

    class NotAtomic(FileBackend):
        set_if_absent = StorageBackend.set_if_absent

    cls = FileBackend if atomic else NotAtomic
    barrier = threading.Barrier(8)
    witnesses = [Witness(cls(str(tmp_path)), ns, "w-even" if i % 2 == 0 else "w-odd") for i in range(8)]
    verdicts = [None] * 8

    def start(i):
        barrier.wait(30)
        verdicts[i] = witnesses[i].allows()

    threads = [threading.Thread(target=start, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if not atomic:
        for w in witnesses:
            w.recheck_s = 0.0
        verdicts = [w.allows() for w in witnesses]
    stored = FileBackend(str(tmp_path)).batch_get([witness_key(ns)])[0]
    winner = "w-even" if b"w-even" in stored else "w-odd"
    for w, ok in zip(witnesses, verdicts):
        if w.mine != winner:   # safety: nobody trusts a namespace that holds other weights
            assert ok is False and w.refused
        elif atomic:           # and with an atomic backend, every engine whose weights match trusts it
            assert ok is True and not w.refused
    if atomic:
        assert sum(w.backend.stats()["bytes_written"] > 0 for w in witnesses) == 1


def test_a_namespace_claimed_by_other_weights_later_is_noticed(tmp_path):
    """The store was emptied and other weights wrote their witness: the trusting engine
    reads it again (here at once: recheck_s 0) before its next read or write and stops."""
    a = named_engine(FileBackend(str(tmp_path)), init_weights(CFG))
    nxt = first_turn(a, seed=6)
    a.storage.witness.recheck_s = 0.0
    FileBackend(str(tmp_path)).clear()
    intruder = Witness(FileBackend(str(tmp_path)), a.storage.witness.namespace, "w-of-other-weights")
    assert intruder.allows()
    saved = a.stats()["storage_saved_objects"]
    r = greedy(nxt, 3)
    a.run([r])
    check_exact(a, r)
    s = a.stats()
    assert r.metrics.storage_tokens == 0 and s["storage_refused"] == 1 and s["storage_saved_objects"] == saved


def test_a_reconnect_asks_again(tmp_path):
    """A backend that reconnected (its `generation` changed) may face an emptied store
    that others claimed since: the witness is read again at once."""
    ns = StorageNamespace.for_model(NAME, 4)
    b = FileBackend(str(tmp_path))
    b.generation = 0
    w = Witness(b, ns, "w-mine")
    assert w.allows()
    b.clear()
    assert Witness(FileBackend(str(tmp_path)), ns, "w-other").allows()
    assert w.allows()      # within RECHECK_S, same connection: still trusted
    b.generation = 1       # reconnected
    assert not w.allows() and w.refused and w.theirs == "w-other"


def test_a_damaged_witness_is_replaced(tmp_path):
    ns = StorageNamespace.for_model(NAME, 4)
    b = FileBackend(str(tmp_path))
    key = witness_key(ns)
    assert b.batch_set([key], [pack_object(key, b"w-mine", ns.seed())[:-2]]) == [True]   # cut short
    w = Witness(b, ns, "w-mine")
    assert w.allows() and w.state == "trusted"
    assert Witness(FileBackend(str(tmp_path)), ns, "w-mine").allows()


def test_witness_keys_follow_the_namespace_and_the_secret():
    ns = StorageNamespace.for_model(NAME, 4)
    k = witness_key(ns)
    assert k.endswith(".witness") and witness_key(ns.with_salt("tenant")) == k   # one per model, every tenant
    assert witness_key(StorageNamespace.for_model(NAME, 8)) != k
    assert witness_key(StorageNamespace.for_model("other", 4)) != k
    assert len({k, witness_key(ns, b"s1"), witness_key(ns, b"s2")}) == 3


def test_metrics_say_l3_is_refused(tmp_path):
    from uniradix.server.metrics import ServerMetrics
    a = named_engine(FileBackend(str(tmp_path)), init_weights(CFG))
    nxt = first_turn(a, seed=7)
    b = named_engine(FileBackend(str(tmp_path)), init_weights(CFG.with_(seed=3)))
    b.run([greedy(nxt, 2)])
    for eng, refused in ((a, 0), (b, 1)):
        text = ServerMetrics().render({"engine": eng.stats(), "output_tokens": 0, "sessions": 0}).decode()
        assert f"uniradix_storage_refused {float(refused)}" in text
        assert f"uniradix_storage_witness_mismatches_total {float(refused)}" in text


@pytest.mark.parametrize("lost", ["removed", "claimed_between_checks"])
def test_other_weights_never_read_objects_whose_witness_key_was_lost(tmp_path, lost):
    """The witness key is one key among the objects: an LRU store evicts it (it is the
    oldest), a clean-up by age removes it, or the store is emptied and other weights
    claim the name while an engine still trusts its last check. The objects stay bound
    to the weights that computed them (their keys carry the witness): other weights read
    nothing and answer as a cache-off engine, and the same weights still share."""
    mine, other = init_weights(CFG), init_weights(CFG.with_(seed=9))
    a = named_engine(FileBackend(str(tmp_path)), mine)
    a.storage.witness.recheck_s = 1e9   # a trusting engine does not look again meanwhile
    if lost == "removed":
        nxt = first_turn(a)
        assert FileBackend(str(tmp_path)).delete(a.storage.witness.key)
        b = named_engine(FileBackend(str(tmp_path)), other)
    else:
        first_turn(a, seed=2)                    # trusted from here on
        FileBackend(str(tmp_path)).clear()       # the store is emptied ...
        b = named_engine(FileBackend(str(tmp_path)), other)
        b.run([greedy([7] * 20, 1)])             # ... and other weights claim the name
        nxt = first_turn(a)                      # the trusting engine writes on
    assert a.stats()["storage_saved_objects"] > 0
    r = greedy(nxt, 6)
    b.run([r])
    check_exact(b, r)
    off = Engine(CFG, weights=other, page_size=4, max_total_tokens=2048, disable_radix_cache=True)
    assert r.output_ids == off.generate(r.input_ids, max_new_tokens=6).output_ids
    assert r.metrics.storage_tokens == 0 and b.stats()["storage_loads"] == 0
    c = Engine(CFG, weights=mine, page_size=4, max_total_tokens=2048, storage=FileBackend(str(tmp_path)),
               prefetch_threshold=1, model_fingerprint=NAME)
    assert c.storage.store.namespace == a.storage.store.namespace   # the same weights: one namespace
    for e in (a, b, c):
        e.close()


def test_one_checkpoint_at_two_dtypes_never_shares_objects(tmp_path):
    """The checkpoint's fingerprint names its files, not the dtype they were loaded at,
    and float16 and bfloat16 pages have one size: only the witness (dtypes and values of
    the loaded tensors) tells them apart. With the witness key lost, the other dtype's
    engine still finds nothing to read, and answers as its own model does."""
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model" / "hf"))
    from harness import make_tiny

    from uniradix.model.hf import load_checkpoint
    path = make_tiny("qwen3", str(tmp_path / "ckpt"))
    store = tmp_path / "l3"

    def eng(dtype):
        return Engine(load_checkpoint(path, dtype), page_size=4, max_total_tokens=2048,
                      storage=FileBackend(str(store)), prefetch_threshold=1)

    a = eng(torch.float16)
    rng = random.Random(5)
    r = greedy([rng.randrange(8, 200) for _ in range(60)], 4)
    a.run([r])
    assert a.stats()["storage_saved_objects"] > 0
    assert FileBackend(str(store)).delete(a.storage.witness.key)
    b = eng(torch.bfloat16)
    r2 = greedy(r.input_ids + r.output_ids + [9, 10, 11], 4)
    b.run([r2])
    check_exact(b, r2)
    assert r2.metrics.storage_tokens == 0 and b.stats()["storage_loads"] == 0
    for e in (a, b):
        e.close()


def _tiny_on_one_store(tmp_path, dtype, seed):
    """(a factory of engines on one tiny checkpoint in `dtype` over one file store, the
    first engine's finished request: it wrote the store)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model" / "hf"))
    from harness import make_tiny

    from uniradix.model.hf import load_checkpoint
    path = make_tiny("qwen3", str(tmp_path / "ckpt"))
    store = tmp_path / "l3"

    def eng():
        return Engine(load_checkpoint(path, dtype=dtype), page_size=4, max_total_tokens=2048,
                      storage=FileBackend(str(store)), prefetch_threshold=1)

    a = eng()
    rng = random.Random(seed)
    r = greedy([rng.randrange(8, 200) for _ in range(60)], 4)
    a.run([r])
    assert a.stats()["storage_saved_objects"] > 0
    return eng, a, r


def test_another_arithmetic_never_shares_objects(tmp_path):
    """One checkpoint at one dtype, computed by the row-invariant kernels and by torch's
    (a node without a compiler, or UNIRADIX_KERNELS=torch): their KV differ in bits, so
    the witness (kernels.identity) keeps them apart, and the second answers as its own
    arithmetic does."""
    from uniradix.model import kernels
    if not kernels.available():
        pytest.skip("the row-invariant kernels are not built here")
    eng, a, r = _tiny_on_one_store(tmp_path, torch.float32, 6)
    with kernels.off():
        assert kernels.identity() == "torch"
        b = eng()
        r2 = greedy(r.input_ids + r.output_ids + [9, 10, 11], 4)
        b.run([r2])
        check_exact(b, r2)
        assert r2.metrics.storage_tokens == 0 and b.stats()["storage_loads"] == 0
        assert b.stats()["storage"]["witness"]["state"] == "refused"
    assert kernels.identity().startswith("row-invariant v")
    c = eng()   # the first arithmetic again: it still reads what it wrote
    r3 = greedy(r2.input_ids, 2)
    c.run([r3])
    check_exact(c, r3)
    assert r3.metrics.storage_tokens > 0
    for e in (a, b, c):
        e.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bfloat16_on_amx_tiles_shares_objects_only_with_amx_tiles(tmp_path, dtype):
    """On a CPU with AMX, bfloat16 products take its tiles: another arithmetic than the
    vector path's chain (a CPU without them), so a bfloat16 model's witness names it and
    KV written with the tiles is refused where they are off (and the other way round),
    while a float32 model, computed the same everywhere, still shares its objects."""
    from uniradix.model import kernels
    if not kernels.amx_bfloat16():
        pytest.skip("no AMX bfloat16 tiles on this CPU")
    eng, a, r = _tiny_on_one_store(tmp_path, dtype, 7)
    with kernels.no_amx():
        b = eng()
        r2 = greedy(r.input_ids + r.output_ids + [9, 10, 11], 4)
        b.run([r2])
        check_exact(b, r2)
        if dtype is torch.bfloat16:
            assert r2.metrics.storage_tokens == 0 and b.stats()["storage"]["witness"]["state"] == "refused"
        else:
            assert r2.metrics.storage_tokens > 0
    for e in (a, b):
        e.close()
