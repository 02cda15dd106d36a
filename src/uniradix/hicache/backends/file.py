"""The file backend: one file per key in a directory. Writes go to a temporary file in
the same directory and are renamed into place, so a reader sees a whole object or
none, even with several engines writing the same key.

A set that fails (disk full, read-only) costs that key: False, counted in set_failures,
warned about once and then in summaries (log_limit.py). A directory that is gone is the
store unavailable (StorageUnavailable) from any call. A path that cannot be a writable
directory is a ValueError at start-up.

Only regular files are read: an entry is looked at with lstat and opened with
O_NOFOLLOW | O_NONBLOCK (then fstat), so a FIFO, a socket, a device, a symbolic link or
a directory under a key's name never blocks a read and is never followed, and a file
larger than any value its readers store (`max_value_bytes`: a sparse or extended file)
is never read into memory. Such an entry is unreadable: a miss, counted (unreadable,
errors), warned about, and removed, so the next write of that key stores it. A read on
a filesystem that hangs (a network mount gone away) blocks only the storage tier's I/O
thread that made it, never the scheduler (see hicache.l3)."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import threading
import uuid

from ..log_limit import LogLimiter
from ..storage import KEY_RE, StorageBackend, StorageUnavailable, check_key

log = logging.getLogger("uniradix.hicache")

DEFAULT_DIR = "/tmp/hicache"
SETTINGS = ("path", "fsync")
COUNTERS = ("gets", "hits", "sets", "set_failures", "errors", "bytes_written", "bytes_read",
            "exists_calls", "deletes", "unreadable")
# a read opens nothing but a regular file, never follows a link, never waits on a FIFO
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class FileBackend(StorageBackend):
    """`path`: the directory (created if missing; it must be writable). `fsync`: flush
    each object to disk before the rename (durable across a crash, slower)."""

    name = "file"

    def __init__(self, path: str = DEFAULT_DIR, fsync: bool = False) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"file backend: path must be a non-empty string (a directory), "
                             f"got {path!r}")
        if not isinstance(fsync, bool):
            raise ValueError(f"file backend: fsync must be true or false, got {fsync!r}")
        self.path = os.path.abspath(path)
        self.fsync = fsync
        _check_writable_dir(self.path)
        self.fstype, self.mount = filesystem_of(self.path)
        shared = self.shared()
        if shared is False:
            log.warning("file backend at %s: a node-local filesystem (%s, mounted at %s): only servers on this "
                        "machine share it; a fleet shares L3 through a shared mount (NFS, Lustre, ...), Redis or "
                        "Mooncake", self.path, self.fstype, self.mount)
        elif shared is None:
            log.warning("file backend at %s (%s, mounted at %s): a node-local directory is not shared between "
                        "machines unless it is a shared mount (NFS, Lustre, ...)", self.path, self.fstype, self.mount)
        else:
            log.info("file backend at %s: a shared filesystem (%s, mounted at %s)", self.path, self.fstype,
                     self.mount)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._lock = threading.Lock()
        self.failure_log = LogLimiter(log, f"file backend at {self.path}")

    def shared(self) -> bool | None:
        """Whether other machines can reach this directory: its filesystem is a network
        or cluster one (True), a local one (False), or one this cannot tell (None: a FUSE
        filesystem, an unknown type)."""
        if self.fstype in SHARED_FILESYSTEMS:
            return True
        if self.fstype in LOCAL_FILESYSTEMS:
            return False
        return None

    def sharing_hint(self) -> str | None:
        """What to say when no other instance shows up in the namespace: why (None where
        there is nothing to suspect)."""
        if self.shared() is False:
            return f"the file store at {self.path} is on a node-local filesystem ({self.fstype})"
        return None

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self.counters[k] += v

    def _file(self, key: str) -> str:
        return os.path.join(self.path, check_key(key))

    def _files(self, keys: list[str]) -> list[str]:
        """Every key checked before any I/O: a bad key in a batch touches nothing."""
        return [self._file(k) for k in keys]

    def _present(self, f: str) -> bool:
        """One lstat; a key it cannot tell about (EACCES, EIO) is absent, counted and
        logged, never raised. An entry that is not a regular file is absent too, and
        removed (`_unreadable`)."""
        try:
            st = os.lstat(f)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            self._require_dir(e)
            self._count(errors=1)
            self.failure_log.failure("failed existence checks", "checking %s failed: %s", f, e)
            return False
        if stat.S_ISREG(st.st_mode):
            return True
        self._unreadable(f, st.st_mode)
        return False

    def _unreadable(self, f: str, mode: int, size: int | None = None) -> None:
        """Something not written here sits under a key's name (an entry that is not a
        regular file, or one of `size` bytes, larger than any value stored here):
        counted, warned about, and removed, so that the key can be stored again (rather
        than block its prefix)."""
        self._count(errors=1, unreadable=1)
        what = _entry_kind(mode) if size is None else (f"{size}-byte file (no stored object is larger than "
                                                       f"{self.max_value_bytes} bytes)")
        try:
            if stat.S_ISDIR(mode):   # renamed first: of two engines removing it, one does
                aside = os.path.join(self.path, f".{os.path.basename(f)[:16]}.{uuid.uuid4().hex}.tmp")
                os.rename(f, aside)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.unlink(f)
        except FileNotFoundError:
            pass
        except OSError as e:
            self.failure_log.failure("unreadable entries", "%s is a %s, not a stored object, and could not "
                                     "be removed: %s", f, what, e)
            return
        self.failure_log.failure("unreadable entries", "%s was a %s, not a stored object: removed", f, what)

    def _oversized(self, st: os.stat_result) -> bool:
        limit = self.max_value_bytes
        return limit is not None and st.st_size > limit

    def _read(self, f: str) -> bytes | None:
        """The bytes of the regular file f; None when absent or unreadable (removed): not
        a regular file, or larger than any value stored here (max_value_bytes; never
        read into memory)."""
        try:
            st = os.lstat(f)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode):
            self._unreadable(f, st.st_mode)
            return None
        if self._oversized(st):
            self._unreadable(f, st.st_mode, st.st_size)
            return None
        try:
            fd = os.open(f, _READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise
            return self._swapped(f)   # replaced by a link, a socket or a directory since the lstat
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):   # replaced by a FIFO or a device since the lstat
                self._unreadable(f, st.st_mode)
                return None
            limit = self.max_value_bytes
            data = fh.read() if limit is None else fh.read(limit + 1)
            if limit is not None and len(data) > limit:   # replaced or grown since the lstat
                self._unreadable(f, st.st_mode, max(os.fstat(fh.fileno()).st_size, len(data)))
                return None
            return data

    def _swapped(self, f: str) -> None:
        try:
            self._unreadable(f, os.lstat(f).st_mode)
        except FileNotFoundError:
            pass
        return None

    def _require_dir(self, cause: OSError | None = None) -> None:
        """After a miss or a failure: the whole directory gone is the store unavailable
        (raised, counted), not a miss or a per-key failure (one stat of it says which)."""
        if not os.path.isdir(self.path):
            self._count(errors=1)
            raise StorageUnavailable(f"file backend: directory {self.path} is gone") from cause

    def batch_exists(self, keys: list[str]) -> int:
        files = self._files(keys)
        self._count(exists_calls=1)
        n = 0
        for f in files:
            if not self._present(f):
                self._require_dir()
                break
            n += 1
        return n

    def batch_contains(self, keys: list[str]) -> list[bool]:
        files = self._files(keys)
        self._count(exists_calls=1)
        found = [self._present(f) for f in files]
        if not all(found):
            self._require_dir()
        return found

    def batch_get(self, keys: list[str]) -> list[bytes | None]:
        out = []
        for f in self._files(keys):
            self._count(gets=1)
            try:
                data = self._read(f)
            except OSError as e:
                self._require_dir(e)
                self._count(errors=1)
                self.failure_log.failure("failed reads", "reading %s failed: %s", f, e)
                out.append(None)
                continue
            if data is not None:
                self._count(hits=1, bytes_read=len(data))
            out.append(data)
        return out

    def batch_set(self, keys: list[str], values: list[bytes]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        files = self._files(keys)
        for v in values:   # before any I/O, like the keys: no temporary left behind
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise TypeError(f"file backend stores bytes, got {type(v).__name__}")
        return [self._set(k, f, v) for k, f, v in zip(keys, files, values)]

    def set_if_absent(self, key: str, value: bytes) -> bool:
        """Atomic: the object is written to a temporary file and hard-linked to the key's
        name, which fails if anything is there (an unreadable entry is removed first).
        Where the filesystem has no hard links, a rename after a check (not atomic)."""
        f = self._file(key)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"file backend stores bytes, got {type(value).__name__}")
        return self._set(key, f, value, exclusive=True)

    def _set(self, key: str, f: str, value: bytes, exclusive: bool = False) -> bool:
        tmp = os.path.join(self.path, f".{key[:16]}.{uuid.uuid4().hex}.tmp")
        self._count(sets=1)
        try:
            self._write(tmp, value)
            if exclusive:
                stored = self._link(tmp, f)
                _unlink_quietly(tmp)   # linked or not, the name is no longer needed
                if not stored:         # something was there: not a failure, nothing stored
                    return False
            else:
                self._replace(tmp, f)
        except OSError as e:  # disk full, quota, permissions: this key is not stored
            self._count(set_failures=1)
            _unlink_quietly(tmp)
            self._require_dir(e)
            self.failure_log.failure("failed sets", "storing %s failed: %s", key, e)
            return False
        self._count(bytes_written=memoryview(value).nbytes)
        return True

    def _replace(self, tmp: str, f: str) -> None:
        """Rename into place; a directory under the key's name (a rename cannot replace
        it) is removed first, then the rename is tried again."""
        try:
            os.replace(tmp, f)
        except OSError as e:
            if e.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            self._present(f)   # removes what is not a regular file
            os.replace(tmp, f)

    def _link(self, tmp: str, f: str) -> bool:
        """Give tmp the key's name unless something is there: False when a regular file
        is (an unreadable entry is removed and the link tried again)."""
        for _ in range(2):
            try:
                os.link(tmp, f)
                return True
            except FileExistsError:
                if self._present(f):
                    return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                if self._present(f):   # no hard links here: check, then rename
                    return False
                self._replace(tmp, f)
                return True
        return False

    def _write(self, tmp: str, value: bytes) -> None:
        with open(tmp, "wb") as fh:
            fh.write(value)
            if self.fsync:
                fh.flush()
                os.fsync(fh.fileno())

    def delete(self, key: str) -> bool:
        f = self._file(key)
        self._count(deletes=1)
        try:
            os.unlink(f)
            return True
        except FileNotFoundError:
            self._require_dir()
            return False
        except IsADirectoryError:   # not ours: removed as unreadable
            return not self._present(f) and not os.path.lexists(f)
        except OSError as e:   # read-only, permissions: not removed
            self._require_dir(e)
            self._count(errors=1)
            self.failure_log.failure("failed deletes", "removing %s failed: %s", f, e)
            return False

    def clear(self) -> None:
        """Remove every key-named file (and leftover temporaries); nothing else."""
        try:
            names = os.listdir(self.path)
        except OSError as e:
            self._count(errors=1)
            raise StorageUnavailable(f"file backend: cannot list directory {self.path}: {e}") from e
        for name in names:
            temporary = name.startswith(".") and name.endswith(".tmp")
            if not (temporary or KEY_RE.match(name)):
                continue
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass
            except IsADirectoryError:   # not ours: removed as unreadable
                self._present(os.path.join(self.path, name))
            except OSError as e:
                self._require_dir(e)
                self._count(errors=1)
                self.failure_log.failure("failed deletes", "removing %s failed: %s", name, e)

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counters)
        return dict(out, backend=self.name, path=self.path)

    def close(self) -> None:
        """Nothing to release; say what failed since the last warning."""
        self.failure_log.flush()

    def __repr__(self) -> str:
        return f"FileBackend(path={self.path!r})"


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _entry_kind(mode: int) -> str:
    """What a non-regular entry is, for the log."""
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISLNK, "symbolic link"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


#: filesystems other machines reach (network and cluster filesystems)
SHARED_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs",
                                "beegfs", "ocfs2", "gfs2", "afs", "panfs", "wekafs", "orangefs", "fuse.glusterfs",
                                "fuse.cephfs", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse", "fuse.sshfs",
                                "fuse.beegfs", "fuse.lustre"})
#: filesystems only this machine reaches
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "tmpfs", "ramfs", "overlay",
                               "f2fs", "jfs", "reiserfs", "vfat", "exfat", "ntfs", "ntfs3", "devtmpfs", "squashfs",
                               "aufs"})


def filesystem_of(path: str, mounts: str = "/proc/mounts") -> tuple[str, str]:
    """(filesystem type, mount point) of the mount holding `path` (the longest mount
    point above it in /proc/mounts); ("unknown", "?") where that cannot be read."""
    real = os.path.realpath(path)
    best = ("unknown", "?")
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    depth = -1
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= depth:
            best, depth = (parts[2], point), len(point)
    return best


def _check_writable_dir(path: str) -> None:
    """Create `path` if missing and write a probe file there: a path under a regular
    file, or a read-only one, is a configuration error (ValueError) at start-up, not a
    failure per key later."""
    what = f"file backend: the 'path' setting {path!r} must be a writable directory"
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{what}; it is a file")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{what}; cannot create it: {e.strerror or e}") from None
    probe = os.path.join(path, f".probe.{uuid.uuid4().hex}.tmp")
    try:
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{what}; cannot write there: {e.strerror or e}") from None
