"""Loading host (L2) data into device pools layer by layer, so that layer N+1 loads while
layer N computes (design.md §4). The forward calls `wait(layer)` before it touches a layer's
pools; only that layer's copies have to be done, not the whole load.

On CPU the copies run on a background thread and each layer has a `threading.Event`. On
CUDA that thread queues them on a side stream (the host side gathered into pinned memory,
so the copies are asynchronous) and records a `torch.cuda.Event` per layer; `wait` makes
the caller's current stream wait on it, and never blocks the host on the device."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..memory.host import HandleCopy
from ..memory.pool import HandlePool
from .codec import handle_nbytes, sidecar_row_nbytes

__all__ = ["CopyJob", "LayerwiseLoad", "TransferError"]


@dataclass(frozen=True)
class CopyJob:
    """Copy what `src_handles[i]` holds in pool `src` into `dst_handles[i]` of pool `dst`."""

    src: HandlePool
    src_handles: object
    dst: HandlePool
    dst_handles: object


class TransferError(RuntimeError):
    """A background copy failed; the exception it raised is the `__cause__`."""


class LayerwiseLoad:
    """Copies `jobs` in the model's layer order (`layer_ids`, compute order), one layer at a
    time: for layer l, every job whose destination pool holds l copies that layer's rows
    (sidecars with the pool's first layer id). Jobs are checked here, on the caller's
    thread, so a bad job fails before anything is copied; a failure during the copies is
    raised, as a `TransferError`, by every `wait` after it. The handles must stay
    allocated, and the destination rows unread, until the layers that hold them are
    waited for. `on_layer_copied(layer)` runs on the copy thread once a layer's copies are
    done (on CUDA: queued), just before `wait(layer)` may return.

    What it moved and how long that took, once it has ended: `nbytes` (the rows of every
    non-empty job, sidecars included), `copy_s` (the copy thread's wall time from its
    first copy to its last: on CUDA the time to queue them) and `cpu_s` (that thread's
    CPU time over the same span; torch's intra-op workers, with more than one thread,
    are not in it)."""

    def __init__(self, jobs: list[CopyJob], layer_ids: list[int], *,
                 on_layer_copied: Callable[[int], None] | None = None):
        self._layer_ids = tuple(int(lid) for lid in layer_ids)
        if len(set(self._layer_ids)) != len(self._layer_ids):
            raise ValueError(f"LayerwiseLoad: duplicate layer ids in {list(self._layer_ids)}")
        copies = [HandleCopy(j.src, j.src_handles, j.dst, j.dst_handles) for j in jobs]
        for c in copies:
            missing = sorted(set(c.dst.layer_ids) - set(self._layer_ids))
            if missing:
                raise ValueError(f"LayerwiseLoad: pool {c.dst.name!r} has layers {missing} "
                                 f"that are not in the load's layers {list(self._layer_ids)}")
        live = [c for c in copies if not c.empty]
        self.nbytes = sum(len(j.src_handles) * (handle_nbytes(j.src) + sum(
            sidecar_row_nbytes(sc) for sc in getattr(j.src, "sidecars", {}).values()))
            for j, c in zip(jobs, copies) if not c.empty)
        self.copy_s = self.cpu_s = 0.0
        self._plan = [(lid, [c for c in live if lid in c.dst.layer_ids]) for lid in self._layer_ids]
        devices = {c.dst.device for c in live if c.dst.device.type == "cuda"}
        if len(devices) > 1:
            raise ValueError(f"LayerwiseLoad: destinations on several devices {sorted(map(str, devices))}")
        self._device = devices.pop() if devices else None
        self._on_layer_copied = on_layer_copied
        self._ready = {lid: threading.Event() for lid in self._layer_ids}
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._started = False
        self._stream = None
        self._events: dict[int, torch.cuda.Event] = {}

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self._layer_ids

    def start(self, executor=None) -> LayerwiseLoad:
        """Begin copying in the background, on `executor` (a concurrent.futures executor)
        if given, else on a daemon thread of its own."""
        if self._started:
            raise RuntimeError("LayerwiseLoad.start() called twice")
        self._started = True
        if self._device is not None:
            self._stream = torch.cuda.Stream(device=self._device)
            # work already queued on the compute stream may still read the pages we overwrite
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            self._events = {lid: torch.cuda.Event() for lid in self._layer_ids}
        if executor is not None:
            try:
                executor.submit(self._run)
            except BaseException:  # e.g. a shut-down executor: nothing will run, so say so
                self._started = False
                raise
        else:
            threading.Thread(target=self._run, name="uniradix-layerwise-load", daemon=True).start()
        return self

    def wait(self, layer_id: int) -> None:
        """Return once layer `layer_id`'s copies are done (CPU), or once the current stream
        is ordered after them (CUDA). A layer the load does not cover returns at once."""
        ready = self._ready.get(layer_id)
        if ready is None:
            return
        self._require_started()
        ready.wait()
        self._raise_if_failed()
        if self._device is not None:
            torch.cuda.current_stream(self._device).wait_event(self._events[layer_id])

    def wait_all(self) -> None:
        """`wait` for every layer."""
        self._require_started()
        self._finished.wait()
        self._raise_if_failed()
        if self._device is not None and self._layer_ids:
            # one side stream: the last layer's event follows every copy
            torch.cuda.current_stream(self._device).wait_event(self._events[self._layer_ids[-1]])

    @property
    def done(self) -> bool:
        """The load has ended: every layer copied (on CUDA: finished on the device too), or
        it failed (`error`, and `wait` raises)."""
        if not self._finished.is_set():
            return False
        if self._error is None and self._device is not None and self._layer_ids:
            return self._events[self._layer_ids[-1]].query()
        return True

    @property
    def error(self) -> BaseException | None:
        """What the copy thread raised, if it failed."""
        return self._error

    def _run(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            if self._device is None:
                self._copy_layers()
            else:
                with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                    self._copy_layers()
        except BaseException as exc:
            self._error = exc
            for ready in self._ready.values():  # wake every waiter: they raise
                ready.set()
        finally:
            self.copy_s, self.cpu_s = time.perf_counter() - t0, time.thread_time() - c0
            self._finished.set()

    def _copy_layers(self) -> None:
        cuda = self._device is not None
        for lid, copies in self._plan:
            for c in copies:
                c.run(lid, non_blocking=cuda)
            if cuda:
                self._events[lid].record(self._stream)
            if self._on_layer_copied is not None:
                self._on_layer_copied(lid)
            self._ready[lid].set()

    def _require_started(self) -> None:
        if not self._started:
            raise RuntimeError("LayerwiseLoad.wait() before start(): it would never return")

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TransferError(f"layerwise load failed: {self._error!r}") from self._error
