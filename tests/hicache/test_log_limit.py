"""The rate limiter of the backends' failure warnings (log_limit.py): the first failure
of a kind in full, then at most one summary per interval, and the rest at flush()."""
import logging
import threading

from uniradix.hicache.log_limit import LogLimiter

log = logging.getLogger("uniradix.test_log_limit")


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == log.name]


def test_first_in_full_then_one_summary_per_interval(caplog):
    clock = Clock()
    lim = LogLimiter(log, "test store", interval=30, clock=clock)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i in range(100):
            lim.failure("failed sets", "storing %s failed: %s", f"k{i}", "disk full")
        assert lines(caplog) == ["test store: storing k0 failed: disk full"]
        assert lim.pending("failed sets") == 99
        clock.t += 29.9
        lim.failure("failed sets", "storing %s failed: %s", "k100", "disk full")
        assert len(lines(caplog)) == 1
        clock.t += 0.1                     # 30 s since the first line
        lim.failure("failed sets", "storing %s failed: %s", "k101", "read-only")
        assert lines(caplog)[1] == ("test store: 101 more failed sets in the last 30 s "
                                    "(latest: storing k101 failed: read-only)")
        assert lim.pending("failed sets") == 0
        clock.t += 10
        lim.failure("failed sets", "storing %s failed: %s", "k102", "read-only", count=4)
        assert len(lines(caplog)) == 2     # the interval counts from the last line
        clock.t += 5
        lim.flush()
        assert lines(caplog)[2] == ("test store: 4 more failed sets in the last 15 s "
                                    "(latest: storing k102 failed: read-only)")
        lim.flush()                        # nothing pending: nothing logged
        assert len(lines(caplog)) == 3


def test_kinds_are_limited_separately(caplog):
    clock = Clock()
    lim = LogLimiter(log, "s", interval=30, clock=clock)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(3):
            lim.failure("failed sets", "set failed")
            lim.failure("failed reads", "read failed")
        assert lines(caplog) == ["s: set failed", "s: read failed"]
        lim.flush()
        assert sorted(lines(caplog)[2:]) == [
            "s: 2 more failed reads in the last 0 s (latest: read failed)",
            "s: 2 more failed sets in the last 0 s (latest: set failed)"]


def test_count_and_a_message_without_arguments(caplog):
    lim = LogLimiter(log, "s", clock=Clock())
    with caplog.at_level(logging.WARNING, logger=log.name):
        lim.failure("refused sets", "%d of %d sets refused: %s", 5, 16, "OOM", count=5)
        lim.failure("refused sets", "100% full", count=7)
        lim.failure("failed reads", "100% full")   # a "%" with no arguments, first of its kind
        lim.flush()
    assert lines(caplog) == ["s: 5 of 16 sets refused: OOM", "s: 100% full",
                             "s: 7 more refused sets in the last 0 s (latest: 100% full)"]


def test_threads_lose_no_count(caplog):
    lim = LogLimiter(log, "s", interval=1e9)

    def work():
        for _ in range(1000):
            lim.failure("failed sets", "x")

    threads = [threading.Thread(target=work) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger=log.name):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert lim.pending("failed sets") == 3999
        lim.flush()
    assert len(lines(caplog)) == 2 and "3999 more failed sets" in lines(caplog)[1]
