"""Layerwise loads from the host tier: the device pools end bit-exact, no layer is read
before its copies are done, the copies run ahead of the compute (layer l+1 is copied while
the forward holds at layer l), failures reach the waiter, and a forward fed by a load
gives the very logits of a forward after a synchronous copy.

The ordering proofs use an event log and gates (conditions with a generous timeout as a
safety net), never clocks."""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from uniradix.hicache.transfer import CopyJob, LayerwiseLoad, TransferError
from uniradix.memory import (
    KVPool,
    MambaStatePool,
    SidecarPool,
    copy_handles,
    host_mirror,
)
from uniradix.model import init_weights, preset, reference_forward
from uniradix.model.paged import PagedInput, paged_forward

CFG = preset("tiny-hybrid").with_(pattern="FSFMFS")  # full [0, 2, 4], swa [1, 5], mamba [3]
LAYERS = list(range(len(CFG.pattern)))
PAGE = 4
GATE_S = 30  # only a safety net: a broken ordering fails fast through the log, not this


def device_pools(device="cpu", pages=32, slots=8):
    H, hd = CFG.n_heads, CFG.head_dim
    kv = dict(page_size=PAGE, num_kv_heads=CFG.n_kv_heads, head_dim=hd, dtype=torch.float32,
              device=device)
    pools = {"full": KVPool(CFG.layers("F"), pages, name="full", **kv),
             "swa": KVPool(CFG.layers("S"), pages, name="swa", **kv),
             "mamba": MambaStatePool(CFG.layers("M"), slots, (H * hd, CFG.conv_kernel - 1),
                                     (H, CFG.state_dim, hd), torch.float32, device)}
    pools["full"].register_sidecar(SidecarPool("scale", (2,), torch.bfloat16, device))
    return pools


def scramble(pool, handles, seed):
    """Garbage in these handles' rows, so data that was not loaded shows."""
    g = torch.Generator().manual_seed(seed)
    parts = [(t, 1) for t in pool.handle_tensors()] + [(sc.tensor, 0) for sc in pool.sidecars.values()]
    for t, dim in parts:
        idx = torch.as_tensor(list(handles), dtype=torch.long, device=t.device)
        junk = torch.randn(t.index_select(dim, idx).shape, generator=g).to(t.dtype)
        t.index_copy_(dim, idx, junk.to(t.device))


def rows(pool, handles):
    """What the handles hold, on the CPU: [:, h] of the pool's tensors, [h] of the sidecars'."""
    parts = [(t, 1) for t in pool.handle_tensors()] + [(sc.tensor, 0) for sc in pool.sidecars.values()]
    return [t.index_select(dim, torch.as_tensor(list(handles), dtype=torch.long, device=t.device)).cpu()
            for t, dim in parts]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Log:
    """A lock-protected event log both threads write, with a gate that waits for an entry."""

    def __init__(self):
        self.entries = []
        self._cond = threading.Condition()

    def note(self, *entry):
        with self._cond:
            self.entries.append(entry)
            self._cond.notify_all()

    def until(self, *entry):
        with self._cond:
            assert self._cond.wait_for(lambda: entry in self.entries, timeout=GATE_S), \
                f"gave up waiting for {entry}; log: {self.entries}"


def host_data(seed=0):
    """Device pools and their host mirrors, with random data in some host handles."""
    dev = device_pools()
    host = {n: host_mirror(p, 2 * p.size) for n, p in dev.items()}
    held = {"full": host["full"].alloc(5), "swa": host["swa"].alloc(3), "mamba": host["mamba"].alloc(2)}
    for i, (n, hs) in enumerate(held.items()):
        scramble(host[n], hs, seed + i)
    return dev, host, held


@pytest.mark.parametrize("executor", [None, "pool"])
def test_a_load_leaves_every_pool_bit_exact(executor):
    dev, host, held = host_data()
    dev["full"].alloc(2)  # so device handles differ from host handles
    fresh = {n: dev[n].alloc(len(hs)) for n, hs in held.items()}
    before = {n: [t.clone() for t in p.handle_tensors()] for n, p in dev.items()}
    jobs = [CopyJob(host[n], held[n], dev[n], fresh[n]) for n in held]
    seen = []
    load = LayerwiseLoad(jobs, LAYERS, on_layer_copied=seen.append)
    if executor:
        with ThreadPoolExecutor(1) as ex:
            load.start(ex)
            load.wait_all()
    else:
        load.start()
        load.wait_all()
    assert load.done and load.error is None and seen == LAYERS
    for n in held:
        assert same(rows(dev[n], fresh[n]), rows(host[n], held[n])), n
        others = torch.as_tensor([h for h in range(dev[n].size) if h not in fresh[n]])
        for t, b in zip(dev[n].handle_tensors(), before[n]):
            assert torch.equal(t.index_select(1, others), b.index_select(1, others))


def on(w, device):
    if isinstance(w, dict):
        return {k: on(v, device) for k, v in w.items()}
    if isinstance(w, list):
        return [on(v, device) for v in w]
    return w.to(device)


def first_turn(device="cpu"):
    """A first request ran on the device, its reusable part (FULL pages and SWA window of
    [0, b), the checkpoint at b) was written to the host, and its device handles freed.
    Returns what a second request that resumes at b needs."""
    w = on(init_weights(CFG), device)
    dev = device_pools(device)
    host = {n: host_mirror(p, 2 * p.size) for n, p in dev.items()}
    first = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    b = 16
    full, swa = dev["full"].alloc(6), dev["swa"].alloc(6)
    slot, ckpt = dev["mamba"].alloc(2)
    dev["mamba"].zero_slots([slot, ckpt])
    paged_forward(CFG, w, dev, [PagedInput(first, 0, {"full": full, "swa": swa}, slot, capture={b: ckpt})])
    lo = max(0, b - CFG.window + 1) // PAGE  # first SWA page the window before b touches
    saved = {"full": full[:b // PAGE], "swa": swa[lo:b // PAGE], "mamba": [ckpt]}
    on_host = {n: host[n].alloc(len(hs)) for n, hs in saved.items()}
    for n, hs in saved.items():
        copy_handles(dev[n], hs, host[n], on_host[n])
    dev["full"].free(full), dev["swa"].free(swa), dev["mamba"].free([slot, ckpt])
    second = first[:b] + torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(9)).tolist()
    return w, dev, host, on_host, second, b, lo


def resume(dev, on_host, second, b, lo, seed):
    """Fresh device handles (with garbage in them) for the second request: the loaded
    ones first, then its own pages for the new tokens."""
    loaded = {n: dev[n].alloc(len(hs)) for n, hs in on_host.items()}
    for n, hs in loaded.items():
        scramble(dev[n], hs, seed)
    n_pages = -(-len(second) // PAGE)
    own = n_pages - b // PAGE
    full = loaded["full"] + dev["full"].alloc(own)
    swa = [-1] * lo + list(loaded["swa"]) + list(dev["swa"].alloc(own))
    inp = PagedInput(second[b:], b, {"full": full, "swa": swa}, loaded["mamba"][0])
    return loaded, inp


def test_a_forward_fed_by_a_load_reads_no_layer_early_and_the_copies_run_ahead():
    """Gates make the interleaving exact: layer l+1's copy completes only once the forward
    has entered layer l, and the forward stays at layer l until layer l+1 is copied. So
    the forward starts on layer 0 while later layers are still to be copied (it waits per
    layer, not for the whole load), the copies proceed while it holds at an earlier layer,
    and every layer is read after its copy."""
    w, dev, host, on_host, second, b, lo = first_turn()

    loaded, inp = resume(dev, on_host, second, b, lo, seed=1)
    for n, hs in loaded.items():
        copy_handles(host[n], on_host[n], dev[n], hs)
    want = paged_forward(CFG, w, dev, [inp])[0]

    loaded, inp = resume(dev, on_host, second, b, lo, seed=2)
    log = Log()

    def copied(layer):  # on the copy thread, once the layer's copies are done
        if layer > 0:
            log.until("read", layer - 1)
        log.note("copied", layer)

    def wait_layer(layer):  # in the forward, before the layer touches a pool
        load.wait(layer)
        log.note("read", layer)
        if layer + 1 < len(LAYERS):
            log.until("copied", layer + 1)

    load = LayerwiseLoad([CopyJob(host[n], on_host[n], dev[n], loaded[n]) for n in on_host], LAYERS,
                         on_layer_copied=copied).start()
    got = paged_forward(CFG, w, dev, [inp], wait_layer=wait_layer)[0]
    load.wait_all()
    assert log.entries == [(e, layer) for layer in LAYERS for e in ("copied", "read")]
    assert torch.equal(got, want)
    assert (got - reference_forward(CFG, w, second)[b:]).abs().max() < 1e-4


def test_free_running_load_under_a_forward():
    """No gates: whatever the interleaving, each layer is read after its copy, and the
    logits are those of a forward after a synchronous copy."""
    w, dev, host, on_host, second, b, lo = first_turn()
    loaded, inp = resume(dev, on_host, second, b, lo, seed=1)
    for n, hs in loaded.items():
        copy_handles(host[n], on_host[n], dev[n], hs)
    want = paged_forward(CFG, w, dev, [inp])[0]

    def load_and_run(seed):
        loaded, inp = resume(dev, on_host, second, b, lo, seed=seed)
        log = Log()
        load = LayerwiseLoad([CopyJob(host[n], on_host[n], dev[n], loaded[n]) for n in on_host],
                             LAYERS, on_layer_copied=lambda layer: log.note("copied", layer)).start()

        def wait_layer(layer):
            load.wait(layer)
            log.note("read", layer)

        got = paged_forward(CFG, w, dev, [inp], wait_layer=wait_layer)[0]
        for n, hs in loaded.items():
            dev[n].free(hs)
        return got, log.entries

    for seed in (2, 3):
        got, entries = load_and_run(seed)
        assert torch.equal(got, want)
        for layer in LAYERS:
            assert entries.index(("copied", layer)) < entries.index(("read", layer))


def test_a_failed_copy_reaches_every_later_wait():
    dev, host, held = host_data()
    fresh = {n: dev[n].alloc(len(hs)) for n, hs in held.items()}
    boom = RuntimeError("copy failed at layer 2")

    def copied(layer):
        if layer == 2:
            raise boom

    load = LayerwiseLoad([CopyJob(host[n], held[n], dev[n], fresh[n]) for n in held], LAYERS,
                         on_layer_copied=copied).start()
    for layer in (2, 3, 5, 0):  # once failed, every wait raises, earlier layers too
        with pytest.raises(TransferError) as e:
            load.wait(layer)
        assert e.value.__cause__ is boom
    with pytest.raises(TransferError):
        load.wait_all()
    assert load.done and load.error is boom
    # what was copied before the failure is there: layer 0 of "full", with its sidecar
    i = dev["full"].layer_ids.index(0)
    idx_d, idx_h = torch.as_tensor(list(fresh["full"])), torch.as_tensor(list(held["full"]))
    for t, s in zip(dev["full"].handle_tensors(), host["full"].handle_tensors()):
        assert torch.equal(t[i].index_select(0, idx_d), s[i].index_select(0, idx_h))
    sc_d, sc_h = dev["full"].sidecars["scale"].tensor, host["full"].sidecars["scale"].tensor
    assert torch.equal(sc_d.index_select(0, idx_d), sc_h.index_select(0, idx_h))


def test_a_bad_job_fails_before_anything_is_copied():
    dev, host, held = host_data()
    before = [t.clone() for t in dev["swa"].handle_tensors()]
    good = CopyJob(host["swa"], held["swa"], dev["swa"], dev["swa"].alloc(3))
    with pytest.raises(ValueError, match="out of range"):
        LayerwiseLoad([good, CopyJob(host["full"], held["full"], dev["full"], [0, 1, 2, 3, 999])], LAYERS)
    with pytest.raises(ValueError, match="not allocated"):
        LayerwiseLoad([CopyJob(host["full"], held["full"], dev["full"], [0, 1, 2, 3, 4])], LAYERS)
    with pytest.raises(ValueError, match=r"layers \[4\]"):  # a pool layer the load would never copy
        LayerwiseLoad([CopyJob(host["full"], held["full"], dev["full"], dev["full"].alloc(5))], [0, 1, 2, 3])
    assert same(dev["swa"].handle_tensors(), before)


def test_zero_jobs_accounting_only_jobs_and_layers_outside_the_load():
    seen = []
    empty = LayerwiseLoad([], LAYERS, on_layer_copied=seen.append)
    empty.wait(99)  # not a layer of the load: returns at once, even before start
    with pytest.raises(RuntimeError, match="before start"):
        empty.wait(0)
    empty.start()
    with pytest.raises(RuntimeError, match="twice"):
        empty.start()
    for layer in LAYERS:
        empty.wait(layer)
    empty.wait_all()
    assert empty.done and seen == LAYERS

    count = KVPool([0, 2], 1000, PAGE, 2, 16, accounting_only=True, name="full")
    mirror = host_mirror(count, 2000)
    load = LayerwiseLoad([CopyJob(mirror, mirror.alloc(4), count, count.alloc(4))], LAYERS).start()
    load.wait_all()
    assert load.done and load.error is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_load_into_cuda_pools_from_pinned_host_mirrors():
    """The CUDA path: copies queued on a side stream from pinned memory, one event per layer,
    the forward's stream ordered after each layer's event; same logits as after a
    synchronous copy, and the pools end bit-exact."""
    w, dev, host, on_host, second, b, lo = first_turn("cuda")
    assert all(p.pin_memory for p in host.values())
    loaded, inp = resume(dev, on_host, second, b, lo, seed=1)
    for n, hs in loaded.items():
        copy_handles(host[n], on_host[n], dev[n], hs)
    want = paged_forward(CFG, w, dev, [inp])[0]
    for seed in (2, 3):
        loaded, inp = resume(dev, on_host, second, b, lo, seed=seed)
        jobs = [CopyJob(host[n], on_host[n], dev[n], loaded[n]) for n in on_host]
        compute = torch.cuda.Stream()  # not the default stream: the events must order it
        compute.wait_stream(torch.cuda.current_stream())  # after the garbage written above
        with torch.cuda.stream(compute):
            load = LayerwiseLoad(jobs, LAYERS).start()
            got = paged_forward(CFG, w, dev, [inp], wait_layer=load.wait)[0]
            load.wait_all()
            torch.cuda.current_stream().synchronize()
        assert load.done and torch.equal(got, want)
        for n in ("full", "swa"):  # the loaded state slot was advanced by the forward
            assert same(rows(dev[n], loaded[n]), rows(host[n], on_host[n])), n
        for n, hs in loaded.items():
            dev[n].free(hs)
