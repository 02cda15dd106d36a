"""Fingerprints of a model's weights, for the L3 namespace: two checkpoints of one
architecture compute different KV, so their stored pages must never meet.

`weights_fingerprint` digests a weights dict in memory (names, dtypes, shapes, bytes).
`file_fingerprint` digests checkpoint files by content alone (not by name or place, so
every node of a fleet that holds the same files gets the same fingerprint), and
remembers each file's digest in a small JSON cache keyed by the file's real path,
size, mtime_ns and inode, so that a restart does not rehash gigabytes.
`weights_witness` is the cheap one: a digest of the names, dtypes, shapes and a few
fixed elements of up to 512 tensors, computed from the loaded tensors in milliseconds
however big the model. `model_witness` is what the L3 tier stores in its namespace and
checks (see hicache.witness): the model's computation (what besides its tensors decides
the KV: PagedModel.computation) with the cheap witness where the namespace's name
already carries the weights' digest, or with every byte of the loaded tensors where it
does not (a fleet's own model_fingerprint: weights that differ anywhere, in a few
embedding rows or in tensors a sample would skip, must not share a name)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CACHE_FILE = "fingerprints.json"
_CACHE_FORMAT = 1
_CHUNK = 4 << 20  # bytes read (and hashed with the GIL released) at a time
# A file modified this recently may change again within the same mtime tick, unseen by
# (size, mtime_ns, inode): its digest is used but not remembered.
_RACY_NS = 2_000_000_000
_PARALLEL_BYTES = 64 << 20  # below this, threads cost more than they save
_warned: set[str] = set()
#: elements a witness reads of each tensor, evenly spaced over its values (first and last included)
WITNESS_SAMPLES = 64
#: tensors a witness reads (name, dtype, shape, elements), at most: evenly spaced in name order
WITNESS_TENSORS = 512


# ---------------------------------------------------------------- the witness
def model_witness(weights, computation: dict, whole: bool) -> str:
    """SHA-256 (hex) of `computation` (JSON) and the weights: all of their bytes
    (weights_fingerprint, about a second per GB) when `whole`, else weights_witness."""
    evidence = weights_fingerprint(weights) if whole else weights_witness(weights)
    text = json.dumps(computation, sort_keys=True, separators=(",", ":"), default=repr).encode()
    h = hashlib.sha256(b"uniradix-model-witness-v2\0" + (b"whole\0" if whole else b"sampled\0"))
    h.update(bytes.fromhex(evidence) + len(text).to_bytes(8, "little") + text)
    return h.hexdigest()


def weights_witness(weights) -> str:
    """SHA-256 (hex) over the number of tensors and, for up to WITNESS_TENSORS of them
    (evenly spaced in the order of their canonical names: the dotted path in the weights,
    "layers.0.wq", or a checkpoint's own name), the name, dtype, shape and WITNESS_SAMPLES
    fixed elements. The same values under the same names give the same witness however
    they were loaded (one file, shards, handed in memory, dequantized from GGUF); other
    weights differ in the sampled elements. It reads a few thousand elements, not the
    weights: milliseconds on any model, on any device (one copy per dtype)."""
    named: list = []
    _named_tensors(weights, "", named)
    named.sort(key=lambda nt: nt[0])
    n = len(named)
    chosen = range(n) if n <= WITNESS_TENSORS else sorted({i * n // WITNESS_TENSORS for i in range(WITNESS_TENSORS)})
    head, by_dtype = [n], {}
    for i in chosen:
        name, t = named[i]
        t = _dense(t)
        if t.layout != torch.strided or t.is_meta:
            raise TypeError(f"weights at {name}: cannot witness a {t.layout} {'meta ' if t.is_meta else ''}tensor")
        t = t.detach()
        head.append([name, str(t.dtype), list(t.shape)])
        if t.numel():
            by_dtype.setdefault(str(t.dtype), []).append(_samples(t))
    h = hashlib.sha256(b"uniradix-witness-v1\0")
    text = json.dumps(head, separators=(",", ":")).encode()
    h.update(len(text).to_bytes(8, "little") + text)
    for dt in sorted(by_dtype):
        h.update(dt.encode() + b"\0" + _tensor_digest(torch.cat(by_dtype[dt])))
    return h.hexdigest()


def _named_tensors(x, prefix: str, out: list) -> None:
    """(dotted name, tensor) for every tensor in nested dicts and lists (a quantized
    weight: the dict of its `tensors()`)."""
    x = _as_dict(x)
    if isinstance(x, torch.Tensor):
        out.append((prefix[:-1], x))
        return
    if isinstance(x, dict):
        items = x.items()
    elif isinstance(x, (list, tuple)):
        items = enumerate(x)
    else:
        raise TypeError(f"weights at {prefix[:-1] or 'the top level'}: expected a tensor, dict or list, "
                        f"got {type(x).__name__}")
    for k, v in items:
        if isinstance(v, torch.Tensor):
            out.append((f"{prefix}{k}", v))
        else:
            _named_tensors(v, f"{prefix}{k}.", out)


def _samples(t: torch.Tensor) -> torch.Tensor:
    """WITNESS_SAMPLES elements of t at fixed, evenly spaced positions of its row-major
    order (read in place: a strided tensor is not copied)."""
    m = t.numel()
    k = min(WITNESS_SAMPLES, m)
    pos = torch.tensor(sorted({i * (m - 1) // max(k - 1, 1) for i in range(k)}), device=t.device)
    if t.is_contiguous():
        return t.reshape(-1)[pos]
    return t[torch.unravel_index(pos, t.shape)]


# ---------------------------------------------------------------- weights in memory
def weights_fingerprint(weights: dict) -> str:
    """SHA-256 (hex) over a weights dict as init_weights / load_weights return it: every
    tensor's path, dtype, shape and bytes (little-endian, row-major), dict entries in
    sorted order, list entries in order. Same content, same fingerprint, on any device.
    Each tensor is hashed on its own (in parallel threads when there is much to hash:
    hashlib releases the GIL), then the structure and the tensors' digests together."""
    records, tensors = [], []
    _walk(weights, [], records, tensors)
    total = sum(t.numel() * t.element_size() for t in tensors)
    workers = min(len(tensors), os.cpu_count() or 1, 8) if total >= _PARALLEL_BYTES else 1
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            digests = iter(list(pool.map(_tensor_digest, tensors)))
    else:
        digests = map(_tensor_digest, tensors)
    h = hashlib.sha256(b"uniradix-weights-v1\0")
    for rec in records:
        text = json.dumps(rec, separators=(",", ":")).encode()
        h.update(len(text).to_bytes(8, "little"))  # length-prefixed: no two structures hash alike
        h.update(text)
        if rec[0] == "tensor":
            h.update(next(digests))
    return h.hexdigest()


def _walk(x, path: list, records: list, tensors: list) -> None:
    """The structure's records and its tensors, in one deterministic order."""
    x = _as_dict(x)
    if isinstance(x, torch.Tensor):
        if x.layout not in (torch.strided, torch._mkldnn) or x.is_meta:
            raise TypeError(f"weights at {_where(path)}: cannot fingerprint a {x.layout} "
                            f"{'meta ' if x.is_meta else ''}tensor")
        records.append(("tensor", path, str(x.dtype), list(x.shape)))
        tensors.append(x)
    elif isinstance(x, dict):
        bad = [k for k in x if type(k) not in (str, int)]
        if bad:
            raise TypeError(f"weights at {_where(path)}: keys must be str or int, got {bad[0]!r:.40}")
        keys = sorted(x, key=lambda k: (type(k) is str, k))
        records.append(("dict", path, keys))
        for k in keys:
            _walk(x[k], path + [k], records, tensors)
    elif isinstance(x, (list, tuple)):
        records.append(("list", path, len(x)))
        for i, v in enumerate(x):
            _walk(v, path + [i], records, tensors)
    else:
        raise TypeError(f"weights at {_where(path)}: expected a tensor, dict or list, got {type(x).__name__}")


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A weight packed for oneDNN (mkldnn layout: model.hf.gemm.pack) as the dense tensor
    of its values, which is what a witness or a fingerprint reads; any other as it is."""
    return t.to_dense() if t.layout == torch._mkldnn else t


def _as_dict(x):
    """A weight held in another form than a tensor (model.hf.quant: int8 codes and
    scales, ...) as the dict of the tensors that define it; anything else as it is."""
    tensors = getattr(x, "tensors", None)
    return tensors() if callable(tensors) and not isinstance(x, torch.Tensor) else x


def _where(path: list) -> str:
    return "".join(f"[{p!r}]" for p in path) or "the top level"


def _tensor_digest(t: torch.Tensor) -> bytes:
    """SHA-256 of the tensor's bytes, read by hashlib straight from its buffer (no
    per-element work; a CPU copy only for a tensor on another device)."""
    t = _dense(t.detach()).resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    raw = t.view(torch.uint8)  # bfloat16 and float8 too: numpy has no such dtypes, bytes it has
    if sys.byteorder == "big" and t.element_size() > 1:  # the same digest on every host
        raw = raw.view(-1, t.element_size()).flip(-1).reshape(-1)
    return hashlib.sha256(raw.numpy().data).digest()


# ---------------------------------------------------------------- checkpoint files
def cache_dir() -> Path:
    """$UNIRADIX_CACHE_DIR, else $XDG_CACHE_HOME/uniradix, else ~/.cache/uniradix."""
    if os.environ.get("UNIRADIX_CACHE_DIR"):
        return Path(os.environ["UNIRADIX_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "uniradix"
    return Path.home() / ".cache" / "uniradix"


def file_fingerprint(paths) -> str:
    """SHA-256 (hex) of checkpoint files' content (`paths`: one path or several): one
    file's digest, or for several (a sharded checkpoint) a digest of their digests in
    sorted order, so names, places and the order given do not matter. Each file is
    hashed once and remembered (see cache_dir); a file whose size, mtime or inode
    changed is hashed again. Files not yet known are hashed in parallel threads."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    paths = [os.path.realpath(os.fsdecode(p)) for p in paths]
    if not paths:
        raise ValueError("file_fingerprint needs at least one file")
    stats = {}
    for p in paths:
        st = os.stat(p)
        if not os.path.isfile(p):
            raise ValueError(f"{p}: not a regular file (pass a checkpoint's files, not its directory)")
        stats[p] = _identity(st)
    try:
        cache_path = cache_dir() / CACHE_FILE
    except RuntimeError as e:  # no home directory to find
        _warn_once("has no place", Path("~/.cache/uniradix"), e)
        cache_path = None
    known = _load_cache(cache_path) if cache_path else {}
    digests = {p: e["digest"] for p in paths if (e := known.get(p)) and _same(e, stats[p])}
    todo = [p for p in dict.fromkeys(paths) if p not in digests]
    if todo:
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1, 8)) as pool:
            fresh = dict(zip(todo, pool.map(_hash_file, todo)))
        now = time.time_ns()
        remember = {}
        for p, (digest, st) in fresh.items():
            digests[p] = digest
            if st == stats[p] and now - st["mtime_ns"] > _RACY_NS:
                remember[p] = dict(st, digest=digest)
            elif st != stats[p]:
                log.warning("%s changed while it was hashed; its fingerprint is not remembered", p)
        if remember and cache_path:
            _store_cache(cache_path, remember)
    if len(paths) == 1:
        return digests[paths[0]]
    h = hashlib.sha256(b"uniradix-files-v1\0")
    for d in sorted(digests[p] for p in paths):
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def _identity(st: os.stat_result) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def _same(entry, ident: dict) -> bool:
    """A remembered entry that is well formed and names this very file."""
    return (isinstance(entry, dict) and isinstance(d := entry.get("digest"), str) and len(d) == 64
            and all(c in "0123456789abcdef" for c in d) and all(entry.get(k) == v for k, v in ident.items()))


def _hash_file(path: str) -> tuple[str, dict]:
    """(SHA-256 hex of the content, the file's identity after reading it), streamed in
    chunks into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
        ident = _identity(os.fstat(f.fileno()))
    return h.hexdigest(), ident


def _warn_once(what: str, cache_path: Path, err: Exception) -> None:
    key = f"{what}:{cache_path}"
    if key not in _warned:
        _warned.add(key)
        log.warning("fingerprint cache %s %s (%s); fingerprints are computed without it", cache_path, what, err)


def _load_cache(cache_path: Path) -> dict:
    """The remembered entries, or {} when the cache is missing, unreadable or corrupt."""
    try:
        with open(cache_path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        _warn_once("is unreadable", cache_path, e)
        return {}
    if not isinstance(data, dict) or data.get("format") != _CACHE_FORMAT or not isinstance(data.get("files"), dict):
        _warn_once("is not a fingerprint cache this build reads", cache_path, ValueError("bad format"))
        return {}
    return data["files"]


def _store_cache(cache_path: Path, new: dict) -> None:
    """Merge `new` into the cache (re-read just before, so what another process wrote
    meanwhile is kept; entries of files that are gone are dropped) and replace the file
    atomically. Any failure leaves the cache as it was."""
    files = {p: e for p, e in _load_cache(cache_path).items() if os.path.exists(p)}
    files.update(new)
    tmp = None
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fingerprints-", suffix=".tmp", dir=cache_path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": _CACHE_FORMAT, "files": files}, f, indent=0, sort_keys=True)
        os.replace(tmp, cache_path)
        tmp = None
    except OSError as e:
        _warn_once("cannot be written", cache_path, e)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
