"""Everything the process writes to its standard error, masked on its way out
(uniradix.redact), native libraries included: Mooncake's client, for one, logs its
metadata server's URL, password and all, straight to file descriptor 2, where no log
filter sees it.

`masked_stderr()` points descriptor 2 at a pipe read by a small child process
(`python -m uniradix.stderr_relay NAME...`, given the setting names declared so far so
that it masks by the same rule) that writes it on to the real standard error, line by
line, masked; a partial line (a progress bar's) goes on as it is once nothing more
comes for a moment. A child, not a thread: a native call that prints while it holds
the GIL would wait forever on a full pipe that only Python code could empty. The relay
ignores SIGINT and SIGTERM (a Ctrl-C or a stop sent to the whole process group must not
cut the server's last lines): it ends when the last write end of its pipe closes, at
the end of the block or when the process exits however it does.

Only the standard library and uniradix.redact."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from .redact import declare_plain, declared_plain, redact

#: seconds a partial line waits for the rest of it before it is written as it is
PARTIAL_LINE_WAIT = 0.05
#: seconds the relay has, once its pipe is closed, to write what is left
RELAY_EXIT_WAIT = 5.0


@contextlib.contextmanager
def masked_stderr():
    """Inside the block, descriptor 2 goes through the masking relay (no relay, and
    stderr as it was, where a child cannot be started)."""
    try:
        saved = os.dup(2)
    except OSError:  # no standard error at all
        yield
        return
    try:
        r, w = os.pipe()
    except OSError:
        os.close(saved)
        yield
        return
    try:
        relay = subprocess.Popen([sys.executable, "-m", __name__, *declared_plain()], stdin=r, stdout=saved,
                                 stderr=saved)
    except OSError:
        for fd in (r, w, saved):
            os.close(fd)
        yield
        return
    os.close(r)
    _flush()
    os.dup2(w, 2)
    os.close(w)
    try:
        yield
    finally:
        _flush()
        os.dup2(saved, 2)  # the pipe's last write end closes: the relay writes what is left and ends
        os.close(saved)
        try:
            relay.wait(RELAY_EXIT_WAIT)
        except subprocess.TimeoutExpired:  # a child of ours holds the pipe open
            relay.kill()
            relay.wait()


def _flush() -> None:
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def relay(src: int = 0, dst: int = 1) -> None:
    """Copy `src` to `dst` until `src` ends, masking each line (the relay's main)."""
    import select
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    pending = b""
    while True:
        if pending and not select.select([src], [], [], PARTIAL_LINE_WAIT)[0]:
            _write(dst, pending)
            pending = b""
            continue
        chunk = os.read(src, 1 << 16)
        if not chunk:
            break
        pending += chunk
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        if cut:
            _write(dst, pending[:cut])
            pending = pending[cut:]
    _write(dst, pending)


def _write(fd: int, data: bytes) -> None:
    out = redact(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")
    try:
        while out:
            out = out[os.write(fd, out):]
    except OSError:  # the real stderr is gone: drop the output, keep draining the pipe
        pass


if __name__ == "__main__":
    declare_plain(sys.argv[1:])
    relay()
