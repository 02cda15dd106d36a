"""A weights fingerprint names the weights' content (and nothing else); a file
fingerprint names the files' content, is hashed once, and is hashed again whenever the
file may have changed; a broken cache costs time, never an error."""
import hashlib
import json
import os

import pytest
import torch

from uniradix.model import (file_fingerprint, init_weights, load_weights, preset, save_weights, weights_fingerprint,
                            weights_witness)
from uniradix.model import fingerprint as fp

CFG = preset("tiny-hybrid")
OLD_NS = 1_600_000_000 * 10**9  # an mtime long past: the file is not "racy"


@pytest.fixture
def weights():
    return init_weights(CFG)


def test_same_content_same_fingerprint(weights):
    assert weights_fingerprint(weights) == weights_fingerprint(weights)
    assert weights_fingerprint(weights) == weights_fingerprint(init_weights(CFG))
    # strides do not matter, only the values
    w = init_weights(CFG)
    w["head"] = w["head"].t().contiguous().t()
    assert not w["head"].is_contiguous()
    assert weights_fingerprint(w) == weights_fingerprint(weights)


def test_two_checkpoints_of_one_config_differ(weights):
    assert weights_fingerprint(init_weights(CFG.with_(seed=1))) != weights_fingerprint(weights)


def test_one_element_changes_it(weights):
    base = weights_fingerprint(weights)
    w = init_weights(CFG)
    w["layers"][-1]["w_down"][3, 5] += 1e-3
    assert weights_fingerprint(w) != base


def test_dtype_shape_and_name_change_it(weights):
    base = weights_fingerprint(weights)
    cast = {**weights, "head": weights["head"].to(torch.float64)}
    assert weights_fingerprint(cast) != base
    bf16 = {**weights, "head": weights["head"].to(torch.bfloat16)}
    assert weights_fingerprint(bf16) not in (base, weights_fingerprint(cast))
    # same bytes in another shape, or under another name
    assert weights_fingerprint({**weights, "head": weights["head"].reshape(-1)}) != base
    layers = [dict(lw) for lw in weights["layers"]]
    layers[0]["w_up2"] = layers[0].pop("w_up")
    assert weights_fingerprint({**weights, "layers": layers}) != base
    # a tensor moved one level does not collide either
    assert weights_fingerprint({"a": {"b": torch.ones(2)}}) != weights_fingerprint({"a": [torch.ones(2)]})
    assert weights_fingerprint({"a": []}) != weights_fingerprint({})


def test_threaded_hashing_gives_the_same_digest(weights, monkeypatch):
    base = weights_fingerprint(weights)
    monkeypatch.setattr(fp, "_PARALLEL_BYTES", 0)
    assert weights_fingerprint(weights) == base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_weights_fingerprint_as_their_cpu_copy(weights):
    bf16 = {**weights, "head": weights["head"].to(torch.bfloat16)}
    on_device = {**bf16, "layers": [{k: t.cuda() for k, t in lw.items()} for lw in bf16["layers"]],
                 "embed": bf16["embed"].cuda()}
    assert weights_fingerprint(on_device) == weights_fingerprint(bf16)


def test_what_is_not_weights_is_refused():
    with pytest.raises(TypeError, match="expected a tensor"):
        weights_fingerprint({"embed": [1.0, 2.0]})
    with pytest.raises(TypeError, match="keys"):
        weights_fingerprint({1.5: torch.ones(1)})


def test_a_checkpoint_loads_to_the_weights_it_was_saved_from(weights, tmp_path):
    path = tmp_path / "w.safetensors"
    save_weights(weights, path, CFG)
    assert weights_fingerprint(load_weights(CFG, path)) == weights_fingerprint(weights)


# ---------------------------------------------------------------- the witness
def test_the_witness_names_the_values_not_the_layout(weights, tmp_path):
    w = weights_witness(weights)
    assert w == weights_witness(init_weights(CFG))
    path = tmp_path / "w.safetensors"
    save_weights(weights, path, CFG)
    assert weights_witness(load_weights(CFG, path)) == w             # from a file
    strided = {**weights, "head": weights["head"].t().contiguous().t()}
    assert not strided["head"].is_contiguous() and weights_witness(strided) == w
    assert weights_witness(init_weights(CFG.with_(seed=1))) != w      # other weights
    assert weights_witness({**weights, "head": weights["head"].to(torch.bfloat16)}) != w
    assert weights_witness({**weights, "head": weights["head"].reshape(-1)}) != w


def test_the_witness_reads_fixed_elements_of_every_tensor(weights):
    """Any tensor changed where the witness looks (its first and last elements among
    them) changes it; a dict of one tensor per name (a checkpoint's own) works alike."""
    base = weights_witness(weights)
    for layer in range(len(weights["layers"])):
        for name in ("wq", "w_down", "conv", "norm2"):
            if name not in weights["layers"][layer]:
                continue
            for where in (0, -1):
                w = init_weights(CFG)
                w["layers"][layer][name].view(-1)[where] += 1e-3
                assert weights_witness(w) != base, (layer, name, where)
    flat = {"model.embed_tokens.weight": torch.ones(4, 3), "lm_head.weight": torch.zeros(3, 4)}
    assert weights_witness(flat) == weights_witness(dict(reversed(flat.items())))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_weights_witness_as_their_cpu_copy(weights):
    bf16 = {**weights, "head": weights["head"].to(torch.bfloat16)}
    on_device = {**bf16, "layers": [{k: t.cuda() for k, t in lw.items()} for lw in bf16["layers"]],
                 "embed": bf16["embed"].cuda()}
    assert weights_witness(on_device) == weights_witness(bf16)


def test_the_witness_does_not_read_the_weights():
    """A tensor of 2**40 elements that is one number seen through a stride of 0: the
    witness looks at a few of its elements and never copies it (a full read or a
    contiguous copy would need terabytes)."""
    huge = torch.ones(1).expand(1 << 40)
    assert len(weights_witness({"huge": huge, "small": torch.arange(10.0)})) == 64
    with pytest.raises(TypeError, match="expected a tensor"):
        weights_witness({"embed": [1.0, 2.0]})


# ---------------------------------------------------------------- files
@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("UNIRADIX_CACHE_DIR", str(d))
    return d


@pytest.fixture
def hashes(monkeypatch):
    """The files actually read and hashed."""
    seen = []
    real = fp._hash_file

    def counting(path):
        seen.append(path)
        return real(path)
    monkeypatch.setattr(fp, "_hash_file", counting)
    return seen


def _file(path, data: bytes, mtime_ns=OLD_NS):
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def test_file_fingerprint_is_the_content_hash_and_is_cached(tmp_path, cache, hashes):
    data = os.urandom(3 * fp._CHUNK + 17)  # several chunks and a partial one
    f = _file(tmp_path / "model.safetensors", data)
    want = hashlib.sha256(data).hexdigest()
    assert file_fingerprint(f) == want
    assert len(hashes) == 1
    assert file_fingerprint(str(f)) == want  # second call: from the cache, the file is not read
    assert len(hashes) == 1
    entry = json.loads((cache / fp.CACHE_FILE).read_text())["files"][os.path.realpath(f)]
    assert entry["digest"] == want and entry["size"] == len(data) and entry["mtime_ns"] == OLD_NS
    # a link to the file is the file
    link = tmp_path / "link"
    link.symlink_to(f)
    assert file_fingerprint(link) == want and len(hashes) == 1


def test_a_changed_file_is_hashed_again(tmp_path, cache, hashes):
    f = _file(tmp_path / "m", b"a" * 100)
    first = file_fingerprint(f)
    _file(f, b"a" * 101)                               # size changes
    second = file_fingerprint(f)
    assert second != first and len(hashes) == 2
    _file(f, b"b" * 101, OLD_NS + 1)                   # same size, mtime changes
    third = file_fingerprint(f)
    assert third not in (first, second) and len(hashes) == 3
    os.utime(f, ns=(OLD_NS + 2, OLD_NS + 2))           # only the mtime: rehashed, same digest
    assert file_fingerprint(f) == third and len(hashes) == 4
    g = _file(tmp_path / "g", b"b" * 101, OLD_NS + 2)  # same size and mtime, another inode
    os.replace(g, f)
    assert file_fingerprint(f) == third and len(hashes) == 5
    assert file_fingerprint(f) == third and len(hashes) == 5


def test_a_file_written_just_now_is_not_remembered(tmp_path, cache, hashes):
    """Its mtime could stay the same through one more write: hash it every time until it
    is old enough."""
    f = tmp_path / "fresh"
    f.write_bytes(b"x" * 10)
    assert file_fingerprint(f) == file_fingerprint(f)
    assert len(hashes) == 2


def test_several_files_by_content_only(tmp_path, cache):
    a = _file(tmp_path / "a", b"shard one")
    b = _file(tmp_path / "b", b"shard two")
    both = file_fingerprint([a, b])
    assert both == file_fingerprint([b, a])
    assert both not in (file_fingerprint(a), file_fingerprint(b))
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    c = _file(elsewhere / "model-00001.safetensors", b"shard one")
    assert file_fingerprint([c, b]) == both  # the same checkpoint, under other names
    with pytest.raises(ValueError):
        file_fingerprint([])
    with pytest.raises(ValueError, match="directory"):
        file_fingerprint(tmp_path)
    with pytest.raises(FileNotFoundError):
        file_fingerprint(tmp_path / "missing")


def test_a_corrupt_cache_is_ignored_and_replaced(tmp_path, cache, hashes):
    f = _file(tmp_path / "m", b"weights")
    want = hashlib.sha256(b"weights").hexdigest()
    cache.mkdir()
    for junk in ("{not json", json.dumps([1, 2]), json.dumps({"format": 99, "files": {}}),
                 json.dumps({"format": 1, "files": {os.path.realpath(f): {"digest": 5}}}),
                 json.dumps({"format": 1, "files": {os.path.realpath(f): {
                     "digest": "zz", "size": 7, "mtime_ns": OLD_NS, "ino": os.stat(f).st_ino}}})):
        (cache / fp.CACHE_FILE).write_text(junk)
        n = len(hashes)
        assert file_fingerprint(f) == want and len(hashes) == n + 1
    assert file_fingerprint(f) == want and len(hashes) == n + 1  # the cache was rewritten


def test_an_unwritable_cache_still_works(tmp_path, monkeypatch, hashes, caplog):
    monkeypatch.setattr(fp, "_warned", set())
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("UNIRADIX_CACHE_DIR", str(blocker / "sub"))  # cannot be made
    f = _file(tmp_path / "m", b"weights")
    assert file_fingerprint(f) == file_fingerprint(f) == hashlib.sha256(b"weights").hexdigest()
    assert len(hashes) == 2
    assert not list(tmp_path.glob("**/.fingerprints-*"))
    assert [r.levelname for r in caplog.records if "cannot be written" in r.getMessage()] == ["WARNING"]


def test_other_processes_entries_are_kept(tmp_path, cache):
    a = _file(tmp_path / "a", b"one")
    file_fingerprint(a)
    b = _file(tmp_path / "b", b"two")
    file_fingerprint(b)
    files = json.loads((cache / fp.CACHE_FILE).read_text())["files"]
    assert set(files) == {os.path.realpath(a), os.path.realpath(b)}
    a.unlink()  # entries of files that are gone are dropped at the next write
    file_fingerprint(_file(tmp_path / "c", b"three"))
    files = json.loads((cache / fp.CACHE_FILE).read_text())["files"]
    assert set(files) == {os.path.realpath(b), os.path.realpath(tmp_path / "c")}


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIRADIX_CACHE_DIR", str(tmp_path / "u"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert fp.cache_dir() == tmp_path / "u"
    monkeypatch.delenv("UNIRADIX_CACHE_DIR")
    assert fp.cache_dir() == tmp_path / "x" / "uniradix"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert fp.cache_dir() == tmp_path / "h" / ".cache" / "uniradix"
