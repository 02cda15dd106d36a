"""Compile a C source for the CPU at hand, once, and cache the library (the row-invariant
kernels, model/kernels/; the pools' row copies, memory/rows.c). Standard library only,
so any layer may use it.

A library built with -march=native is keyed by everything that decides its code: the
source, the compiler and its version, the flags, and the CPU (model and feature flags):
a cache shared between machines (a home directory on NFS) never hands one CPU another's
instructions. Two processes building at once each write a file of their own and rename
it into place."""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path


class BuildError(RuntimeError):
    """No compiler, or the compiler refused the source."""


def cache_dir() -> Path:
    root = os.environ.get("UNIRADIX_KERNEL_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "uniradix" / "kernels"


def compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BuildError("no C compiler found (install gcc, or set CC)")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            keep = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(keep)))
    except OSError:
        return platform.processor() or platform.machine()


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cc} --version failed: {e}") from None


def library(source: Path, flags: list[str], name: str) -> str:
    """The path of `source` compiled with `flags` into a shared library (cached as
    `name`_<key>.so), built now if the cache lacks it."""
    cc = compiler()
    text = source.read_bytes()
    key = hashlib.sha256(b"\0".join([text, _version(cc).encode(), " ".join(flags).encode(), _cpu().encode(),
                                     platform.machine().encode()])).hexdigest()[:20]
    out = cache_dir() / f"{name}_{key}.so"
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise BuildError(f"{cc} failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"building {source.name} failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(out)
