"""Raw baselines for the tiers' loads, measured in the same run as the engine's: what
the same bytes cost with nothing of the engine around them.

- L2 (host -> device): a plain torch copy (`dst.copy_(src)`, a memcpy on the CPU) of
  blocks the size of the engine's mean load, as many times as the bytes the engine
  loaded (bounded by `max_s`), on the run's torch threads, cycling over up to 512 MB so
  that the bytes are not in the CPU's caches (the engine's come from a large pool).
- L3 (store -> host): values of the engine's mean object size, written under keys of
  their own and read straight from the store's client in batches of the engine's mean
  objects per read: redis-py's GET in one pipeline per batch (the Redis backend's one
  round trip per batch_get), the Mooncake client's get_batch, or reading files
  (open + read, one file per value, as the file backend stores them). Only the reads
  are timed, one batch after the other (the engine's two read threads may overlap
  theirs: its seconds are summed per call, so both sides are per-call bandwidths).

Each returns bytes per second (None when there was nothing to measure)."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

#: the most distinct values a raw L3 read cycles over (their bytes are also bounded)
MAX_VALUES = 4096
MAX_VALUE_BYTES_TOTAL = 256 << 20
#: the bytes a raw memcpy cycles over (well past a CPU's last-level cache)
MEMCPY_SPAN = 512 << 20


def memcpy_bps(block_bytes: int, total_bytes: int, max_s: float = 3.0) -> float | None:
    """Bytes per second of torch copies of `block_bytes`, repeated until `total_bytes`
    were copied or `max_s` passed. The blocks are taken in turn from buffers of up to
    MEMCPY_SPAN bytes (each touched once first), so that, like the engine's loads from
    a large host pool, a copy does not find its bytes in the CPU's caches."""
    import torch
    if block_bytes <= 0 or total_bytes <= 0:
        return None
    n = max(1, min(total_bytes, MEMCPY_SPAN) // block_bytes)
    src = torch.ones(n * block_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    done, i, t0 = 0, 0, time.perf_counter()
    while done < total_bytes:
        lo = i * block_bytes
        dst[lo:lo + block_bytes].copy_(src[lo:lo + block_bytes])
        done += block_bytes
        i = (i + 1) % n
        if time.perf_counter() - t0 > max_s:
            break
    return done / (time.perf_counter() - t0)


def _plan(size: int, batch: int, count: int) -> tuple[int, int, int]:
    """(distinct values, batch, reads) for `count` reads of `size`-byte values."""
    size, batch = max(1, int(size)), max(1, int(batch))
    distinct = max(batch, min(count, MAX_VALUES, max(1, MAX_VALUE_BYTES_TOTAL // size)))
    return distinct, min(batch, distinct), count


def _batches(distinct: int, batch: int, count: int):
    """Index lists of `batch` values (cycling over `distinct`) until `count` were read."""
    i = 0
    while count > 0:
        n = min(batch, count)
        yield [(i + k) % distinct for k in range(n)]
        i = (i + n) % distinct
        count -= n


def redis_get_bps(url: str, size: int, batch: int, count: int, max_s: float = 5.0) -> float | None:
    """redis-py GETs of `size`-byte values, one pipeline per batch of `batch`."""
    import redis
    if count <= 0:
        return None
    distinct, batch, count = _plan(size, batch, count)
    r = redis.Redis.from_url(url, socket_timeout=30)
    names = [f"raw-baseline:{i}" for i in range(distinct)]
    value = os.urandom(int(size))
    try:
        for i in range(0, distinct, 256):
            p = r.pipeline(transaction=False)
            for n in names[i:i + 256]:
                p.set(n, value)
            p.execute()
        done, t0 = 0, time.perf_counter()
        for idx in _batches(distinct, batch, count):
            p = r.pipeline(transaction=False)
            for i in idx:
                p.get(names[i])
            done += sum(len(v) for v in p.execute())
            if time.perf_counter() - t0 > max_s:
                break
        bps = done / (time.perf_counter() - t0)
        for i in range(0, distinct, 1000):
            r.delete(*names[i:i + 1000])
        return bps
    finally:
        r.close()


def mooncake_get_bps(config: dict, size: int, batch: int, count: int, max_s: float = 5.0) -> float | None:
    """The Mooncake client's get_batch of `size`-byte values, `batch` at a time, from a
    client of its own set up as the engine's (`config`: its extra config; it lends no
    memory, so the values go to the lender's, as the engine's objects did)."""
    from mooncake.store import MooncakeDistributedStore
    if count <= 0:
        return None
    distinct, batch, count = _plan(size, batch, count)
    store = MooncakeDistributedStore()
    rc = store.setup(config["local_hostname"], config["te_meta_data_server"], config["global_segment_size"],
                     config["local_buffer_size"], config["protocol"], "", config["master"])
    if rc != 0:
        raise RuntimeError(f"raw Mooncake client: setup returned {rc}")
    names = [f"raw-baseline:{i}" for i in range(distinct)]
    value = os.urandom(int(size))
    per = max(1, (config["local_buffer_size"] // 2) // int(size))   # puts cut to half the buffer, as the backend's
    try:
        for i in range(0, distinct, per):
            chunk = names[i:i + per]
            rc = store.upsert_batch(chunk, [value] * len(chunk))
            if rc != 0:
                raise RuntimeError(f"raw Mooncake client: upsert_batch returned {rc}")
        done, t0 = 0, time.perf_counter()
        for idx in _batches(distinct, batch, count):
            got = store.get_batch([names[i] for i in idx])
            n = [len(v) for v in got]
            if min(n) == 0:
                raise RuntimeError("raw Mooncake client: a get came back empty")
            done += sum(n)
            if time.perf_counter() - t0 > max_s:
                break
        bps = done / (time.perf_counter() - t0)
        store.remove_by_regex("^raw-baseline:", True)
        return bps
    finally:
        store.close()


def file_read_bps(parent: str, size: int, batch: int, count: int, max_s: float = 5.0) -> float | None:
    """Reading `size`-byte files (open, read, close), in a new directory under `parent`
    (where the store's are: the same filesystem), one file per value."""
    if count <= 0:
        return None
    distinct, batch, count = _plan(size, batch, count)
    d = tempfile.mkdtemp(prefix="raw-baseline-", dir=parent)
    try:
        value = os.urandom(int(size))
        files = [os.path.join(d, f"{i:06d}") for i in range(distinct)]
        for f in files:
            with open(f, "wb") as fh:
                fh.write(value)
        done, t0 = 0, time.perf_counter()
        for idx in _batches(distinct, batch, count):
            for i in idx:
                with open(files[i], "rb") as fh:
                    done += len(fh.read())
            if time.perf_counter() - t0 > max_s:
                break
        return done / (time.perf_counter() - t0)
    finally:
        shutil.rmtree(d, ignore_errors=True)
