"""The README stands alone: it names nothing outside the repository (a clone has no
../shared), and every repository path it names exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "design.md", ROOT / "benchmarks" / "peers" / "README.md"]


def test_no_reference_outside_the_repository():
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        assert "../shared" not in text, doc


def test_every_repository_path_named_exists():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:src/uniradix|benchmarks|tests|docs)/[\w./-]*\w)`", text))
    assert len(named) > 20, named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing
