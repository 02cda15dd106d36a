import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_proc import ServerProc  # noqa: E402


@pytest.fixture(scope="module")
def server():
    """One server on the embedded model for a test module; it must stop with exit 0."""
    s = ServerProc("--max-total-tokens", "4096", "--max-running-requests", "8")
    yield s
    assert s.stop() == 0, "".join(s.lines[-30:])
