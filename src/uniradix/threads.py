"""How many CPU threads torch computes with in `uniradix run` and `serve`: the
--num-threads flag, else $OMP_NUM_THREADS (what users already set for OpenMP
programs), else one. Applied once at start-up, before the model loads, and said on
start-up. One is the default because a thread pool sized to every core only pays off on
an otherwise idle machine: when anything else runs, OpenMP's threads wait for the one
that lost its core at every matmul, and a step takes several times longer than on one
thread (docs/engine.md, *Threads*, has the figures)."""
from __future__ import annotations

import os

#: the variable OpenMP programs (torch among them) read their thread count from
THREADS_ENV = "OMP_NUM_THREADS"
#: threads when neither the flag nor the variable says
DEFAULT_THREADS = 1


def resolve_threads(flag: int | None, environ=None) -> tuple[int, str]:
    """(threads, where the number came from). `flag`: --num-threads, already checked
    (a positive int) or None. $OMP_NUM_THREADS may be an OpenMP list ("4,2": the first
    level counts); anything else that is not a positive integer is refused, naming it."""
    if flag is not None:
        return flag, "--num-threads"
    raw = (os.environ if environ is None else environ).get(THREADS_ENV, "").strip()
    if not raw:
        return DEFAULT_THREADS, "the default"
    first = raw.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ValueError(f"${THREADS_ENV} must be a positive integer, got {raw!r}; unset it or give --num-threads")
    return int(first), f"${THREADS_ENV}"


def apply_threads(n: int) -> bool:
    """torch computes with n threads from now on; its inter-op pool is sized to n too
    where that can still be set (only before any parallel work has started). True when
    both were set."""
    import torch
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # already set, or parallel work has started: it stays as it is
        return False
    return True


def start_threads(flag: int | None) -> str:
    """Resolve and apply the thread count; the start-up line that says it."""
    import torch
    n, source = resolve_threads(flag)
    apply_threads(n)
    n = torch.get_num_threads()
    return f"{n} compute thread{'s' if n != 1 else ''} ({source}; {_cpus()} CPUs available)"


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


__all__ = ["THREADS_ENV", "DEFAULT_THREADS", "resolve_threads", "apply_threads", "start_threads"]
