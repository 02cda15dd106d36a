"""The pages stand alone: the README, every page under docs/ (found by name, so a new
page is held to the same) and benchmarks/peers/README.md name nothing outside the
repository (a clone has no ../shared), every repository path they name exists, every
link between them resolves (to a heading that exists, where it names one), and the
README links every page under docs/."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [ROOT / "README.md", *PAGES, ROOT / "benchmarks" / "peers" / "README.md"]


def _prose(doc: Path) -> str:
    """The page without its fenced blocks (a `# comment` in a shell block is no heading)."""
    return re.sub(r"^```.*?^```[ \t]*$", "", doc.read_text(encoding="utf-8"), flags=re.S | re.M)


def _anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives the page's headings."""
    anchors, count = set(), {}
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _prose(doc), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = count[slug] = count.get(slug, -1) + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")  # a repeated title: -1, -2, ...
    return anchors


def test_the_pages_are_found():
    assert ROOT / "docs" / "design.md" in PAGES and len(PAGES) >= 8, PAGES


def test_no_reference_outside_the_repository():
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        assert "../shared" not in text, doc


def test_every_repository_path_named_exists():
    total = set()
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        named = set(re.findall(r"`((?:src/uniradix|benchmarks|tests|docs)/[\w./-]*\w)`", text))
        missing = sorted(p for p in named if not (ROOT / p).exists())
        assert not missing, (doc.relative_to(ROOT), missing)
        total |= named
    assert len(total) > 20, total


def test_the_readme_links_every_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]*)?\)", readme))
    unlinked = sorted(f"docs/{p.name}" for p in PAGES if f"docs/{p.name}" not in linked)
    assert not unlinked, f"pages the README does not link: {unlinked}"


def test_links_between_pages_resolve():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(doc)):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists() or ROOT not in dest.parents:
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file in the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken
