"""A real mooncake_master for tests: on 127.0.0.1 at a free port (its RPC port and its
admin/metrics HTTP port both bound to 127.0.0.1, no HTTP metadata server: clients use
P2PHANDSHAKE), in a temporary directory, stopped by its PID at the end (see
service_process.py).

    with master_address() as addr: ...     # yields "127.0.0.1:PORT"
    with master_server() as m:             # m.address, m.port, m.pid, m.stop(kill=True),
        ...                                #   m.start() again on the same port, m.log_tail()
    with master_server("--default_kv_lease_ttl=200"): ...   # extra flags

`start_master(...)` gives the same `MooncakeMaster` for fixtures that stop it
themselves (`m.cleanup()`). `require_mooncake()` checks that the Mooncake store can be
used at all: the mooncake_master binary, libibverbs, and `import mooncake.store`.
Without them the test is skipped, saying what to install, except when the CI
environment variable is set: there the test fails, since CI must have them.

The binary is the one inside the `mooncake` package (the `mooncake_master` console
script only execs it); the PID we hold is the master's own.
"""
from __future__ import annotations

import contextlib
import ctypes.util
import socket

from service_process import HOST, ServiceProcess, free_port, missing

START_TIMEOUT = 120.0   # a guard against a hang only (a loaded machine starts it slowly)
PIP_PACKAGE = "mooncake-transfer-engine-non-cuda"

# The master's settings for tests. Eviction: start at 90% of the mounted memory and
# drop 10% of the objects; a read lease of 1 s (the default is 10 s) so that eviction
# is not held up long by recent reads.
DEFAULT_FLAGS = (
    "--enable_http_metadata_server=false",
    "--http_metadata_server_host=" + HOST,
    "--enable_metric_reporting=false",
    "--rpc_thread_num=2",
    "--eviction_high_watermark_ratio=0.9",
    "--eviction_ratio=0.1",
    "--default_kv_lease_ttl=1000",
)


def master_binary() -> str:
    """The mooncake_master executable, or skip/fail saying what to install."""
    from uniradix.hicache.backends.mooncake_client import master_binary as find
    path = find()
    if path:
        return path
    missing(f"mooncake_master not found: pip install {PIP_PACKAGE}")
    raise AssertionError("unreachable")


def require_mooncake() -> str:
    """Check the master binary, libibverbs and the Python client; return the binary."""
    binary = master_binary()
    if not ctypes.util.find_library("ibverbs"):
        missing("libibverbs (needed by Mooncake even for TCP) not found: "
                "apt-get install libibverbs1")
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        missing(f"cannot import mooncake.store ({e}): pip install {PIP_PACKAGE}")
    return binary


def _accepts(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


class MooncakeMaster(ServiceProcess):
    name = "mooncake_master"
    tag = "mooncake"
    log_name = "master.log"
    start_timeout = START_TIMEOUT
    log_lines = 8
    not_ready = "did not accept connections"

    def __init__(self, *flags: str, port: int | None = None) -> None:
        super().__init__(*flags, port=port)
        self.metrics_port = free_port()

    find_binary = staticmethod(require_mooncake)

    @property
    def flags(self) -> list[str]:
        return self.args

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def ports(self) -> tuple[int, ...]:
        return (self.port, self.metrics_port)

    def choose_ports(self) -> None:
        self.port, self.metrics_port = free_port(), free_port()

    def command(self) -> list[str]:
        return [self.binary, f"--rpc_address={HOST}", f"--rpc_port={self.port}",
                f"--metrics_host={HOST}", f"--metrics_port={self.metrics_port}",
                *DEFAULT_FLAGS, *self.args]

    def ready(self) -> bool:
        return _accepts(self.port)


def start_master(*flags: str, port: int | None = None) -> MooncakeMaster:
    """A started master; the caller calls `.cleanup()` (stop it, remove its directory)."""
    return MooncakeMaster(*flags, port=port).start()


def master_server(*flags: str, port: int | None = None):
    """Start a mooncake_master (extra flags go on its command line), yield the
    `MooncakeMaster`, stop it."""
    return MooncakeMaster.running(*flags, port=port)


@contextlib.contextmanager
def master_address(*flags: str, port: int | None = None):
    """Start a mooncake_master, yield its address "127.0.0.1:PORT", stop it."""
    with master_server(*flags, port=port) as m:
        yield m.address
