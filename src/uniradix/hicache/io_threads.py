"""The storage tier's I/O threads: a few daemon threads that run submitted calls and
answer with concurrent.futures Futures.

Not a ThreadPoolExecutor: its workers are joined when the interpreter exits, so one
call stuck in a store (a FIFO, a hung network filesystem, a server that never answers)
would keep the process alive after SIGTERM. A daemon thread stuck in a call is left
behind at exit; `shutdown` never waits for one. `calls_in_progress` says how many calls
are still running on any of them: a process that ends with one inside a native client
(Mooncake's) must not run that library's teardown under it, which can wait for its own
timeouts and then crash (see uniradix.cli)."""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

_busy = 0   # calls running on any DaemonThreads now
_busy_lock = threading.Lock()


def calls_in_progress() -> int:
    """Calls running now on the storage tiers' daemon threads, all of them together."""
    with _busy_lock:
        return _busy


def _count_busy(n: int) -> None:
    global _busy
    with _busy_lock:
        _busy += n


class DaemonThreads:
    """`workers` daemon threads named `name`-N, started on the first submit."""

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the I/O threads are shut down")
            self._queue.put((fut, fn, args))
            while len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)
        return fut

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            _count_busy(1)
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - the caller sees it through the future
                fut.set_exception(e)
            else:
                fut.set_result(result)
            finally:
                _count_busy(-1)

    def shutdown(self, timeout: float = 0.0) -> bool:
        """Cancel what has not started, let the threads end after their current call, and
        wait for them at most `timeout` seconds. True when every thread has ended."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if timeout > 0:
            deadline = time.monotonic() + timeout
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)


def call_within(fn, timeout: float, name: str = "uniradix-close") -> bool:
    """Run fn() on a daemon thread and wait at most `timeout` seconds; True when it
    ended (what it raised is logged, never raised here). One that did not end runs on,
    counted in calls_in_progress: closing a store that hangs must not hold a stopping
    process past its deadline."""
    import logging
    threads = DaemonThreads(1, name)
    fut = threads.submit(fn)
    try:
        fut.result(timeout=max(0.0, timeout))
    except TimeoutError:
        return False
    except Exception:  # noqa: BLE001 - a close that fails must not stop the shutdown
        logging.getLogger("uniradix.hicache").exception("%s failed", getattr(fn, "__qualname__", fn))
    finally:
        threads.shutdown()
    return True
