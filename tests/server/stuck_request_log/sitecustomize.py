"""Loaded at start-up by a `uniradix serve` whose PYTHONPATH names this folder
(tests/server/test_request_log.py): its --request-log sink stops taking lines, as a
stuck disk would. Every open of the log gives the write end of one pipe that nothing
reads, shrunk to a page, and the writer's queue holds about 8 records."""
import fcntl
import os

from uniradix.server import request_log

_unread, _stuck = os.pipe()
fcntl.fcntl(_stuck, fcntl.F_SETPIPE_SZ, 4096)


def _stuck_sink(path: str) -> int:
    return os.dup(_stuck)


request_log.open_sink = _stuck_sink
request_log.QUEUE_BYTES = 8 * 512
