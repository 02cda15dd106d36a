"""Every component's data (FULL and SWA pages across layers, MAMBA conv and recurrent
state, sidecar rows) leaves a pool as bytes and comes back bit-exact, through the
object format and a storage backend."""
import pytest
import torch

from uniradix.engine import build_cache
from uniradix.hicache import CorruptObject, StorageNamespace, component_key, pack_object, page_keys, unpack_object
from uniradix.hicache.backends.file import FileBackend
from uniradix.hicache.codec import (handle_nbytes, read_handles, read_sidecar_rows, write_handles,
                                    write_sidecar_rows)
from uniradix.memory import KVPool, SidecarPool
from uniradix.model import preset


def filled_pools(dtype, seed):
    cfg = preset("tiny-hybrid").with_(dtype=dtype)
    _, pools = build_cache(cfg, page_size=4, max_total_tokens=64, max_mamba_cache_size=8)
    g = torch.Generator().manual_seed(seed)
    sc = pools["full"].register_sidecar(SidecarPool("scales", (2,), torch.float16))
    for p in pools.values():
        for t in p.handle_tensors():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    sc.tensor.copy_(torch.randn(sc.tensor.shape, generator=g).to(sc.tensor.dtype))
    return cfg, pools, sc


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_component_and_sidecar_round_trips_through_storage(tmp_path, dtype):
    cfg, src, src_sc = filled_pools(dtype, 0)
    _, dst, dst_sc = filled_pools(dtype, 1)  # different contents to be overwritten
    ns = StorageNamespace.for_model(cfg, 4)
    keys = page_keys(list(range(12)), ns)  # three pages
    store = FileBackend(str(tmp_path))
    handles = {"full": [5, 0, 9], "swa": [2, 3, 4], "mamba": [7]}
    targets = {"full": [1, 2, 3], "swa": [10, 11, 12], "mamba": [0]}
    objs = {}
    for name, hs in handles.items():
        blobs = read_handles(src[name], hs)
        assert all(len(b) == handle_nbytes(src[name]) for b in blobs)
        ks = [component_key(keys[-1], name)] if name == "mamba" else \
            [k if name == "full" else component_key(k, name) for k in keys]
        objs[name] = ks
        store.batch_set(ks, [pack_object(k, b, ns.seed()) for k, b in zip(ks, blobs)])
    sk = [component_key(k, "full_scales") for k in keys]
    store.batch_set(sk, [pack_object(k, b, ns.seed()) for k, b in zip(sk, read_sidecar_rows(src_sc, handles["full"]))])
    for name, ks in objs.items():
        blobs = [unpack_object(d, k, ns.seed()) for k, d in zip(ks, store.batch_get(ks))]
        write_handles(dst[name], targets[name], blobs)
        for a, b in zip(src[name].handle_tensors(), dst[name].handle_tensors()):
            assert torch.equal(a[:, handles[name]], b[:, targets[name]])  # bit-exact
    rows = [unpack_object(d, k, ns.seed()) for k, d in zip(sk, store.batch_get(sk))]
    write_sidecar_rows(dst_sc, targets["full"], rows)
    assert torch.equal(src_sc.tensor[handles["full"]], dst_sc.tensor[targets["full"]])


def test_a_corrupt_stored_page_is_refused(tmp_path):
    cfg, src, _ = filled_pools("float32", 0)
    ns = StorageNamespace.for_model(cfg, 4)
    k = page_keys([1, 2, 3, 4], ns)[0]
    store = FileBackend(str(tmp_path))
    store.batch_set([k], [pack_object(k, read_handles(src["full"], [3])[0], ns.seed())])
    path = tmp_path / k
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObject, match="checksum"):
        unpack_object(store.batch_get([k])[0], k, ns.seed())
    path.write_bytes(bytes(data[:-7]))
    with pytest.raises(CorruptObject, match="length"):
        unpack_object(store.batch_get([k])[0], k, ns.seed())
    # another model's namespace never reads it
    other = StorageNamespace.for_model(cfg.with_(window=8), 4)
    store.batch_set([k], [pack_object(k, read_handles(src["full"], [3])[0], ns.seed())])
    with pytest.raises(CorruptObject, match="namespace"):
        unpack_object(store.batch_get([k])[0], k, other.seed())


def test_blob_sizes_are_checked():
    kv = KVPool([0], 4, 2, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="bytes"):
        write_handles(kv, [0], [b"short"])
    with pytest.raises(ValueError, match="blobs"):
        write_handles(kv, [0, 1], [bytes(handle_nbytes(kv))])
    # a pool that only counts (FULL of a model with no full-attention layer) travels as
    # empty objects: present, holding nothing
    acc = KVPool([0], 4, 2, 1, 4, torch.float32, accounting_only=True)
    assert handle_nbytes(acc) == 0 and read_handles(acc, [0, 3]) == [b"", b""]
    write_handles(acc, [0, 3], [b"", b""])
    with pytest.raises(ValueError, match="bytes"):
        write_handles(acc, [0], [b"x"])
