"""Compile kernels.c for the CPU at hand, once, and cache the library (uniradix.native
does the building and keys the cache by source, compiler, flags and CPU)."""
from __future__ import annotations

from pathlib import Path

from ...native import BuildError, cache_dir, compiler, library as _library

__all__ = ["BuildError", "FLAGS", "SOURCE", "cache_dir", "compiler", "library"]

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]


def library(march: str = "native") -> str:
    """The path of the compiled library, built now if the cache lacks it. `march`: the
    CPU level to build for (another than this CPU's: its AVX2 or scalar paths on an
    AVX-512 machine, for a test that they give the same bits, or an A/B run)."""
    flags = [f"-march={march}" if f == "-march=native" else f for f in FLAGS]
    return _library(SOURCE, flags, "uniradix_kernels")
