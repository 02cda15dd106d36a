"""Let `python -m pytest tests/memory` find the src-layout package when it
is not installed."""

import os
import sys

try:
    import uniradix  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src")))
