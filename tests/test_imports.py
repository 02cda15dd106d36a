"""The layers of docs/design.md, held: every import in src/uniradix (module level and
inside functions alike, read with ast) points down. No two modules import each other
through any path, the model never imports the engine (or anything above it), and the
tree core imports nothing but the standard library."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "uniradix"
#: what lies above each layer: it must not import these
ABOVE = {"uniradix.tree": ("uniradix.specs", "uniradix.memory", "uniradix.cache", "uniradix.hicache",
                           "uniradix.model", "uniradix.engine", "uniradix.server", "uniradix.bench", "uniradix.cli"),
         "uniradix.model": ("uniradix.engine", "uniradix.server", "uniradix.bench", "uniradix.cli"),
         "uniradix.cache": ("uniradix.engine", "uniradix.server", "uniradix.bench", "uniradix.cli"),
         "uniradix.engine": ("uniradix.server", "uniradix.bench", "uniradix.cli")}


def modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the uniradix modules it imports, module -> the other top-level names)."""
    inner, outer = {}, {}
    for m, path in mods.items():
        here = m.split(".") if path.name == "__init__.py" else m.split(".")[:-1]
        found, other = set(), set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here[:len(here) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                if not t.startswith("uniradix"):
                    other.add(t.split(".")[0])
                    continue
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t != m:
                    found.add(t)
        inner[m], outer[m] = found, other
    return inner, outer


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = n
        n += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = n
                n += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_no_two_modules_import_each_other():
    inner, _ = imports(modules())
    assert cycles(inner) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_point_down():
    inner, _ = imports(modules())
    wrong = [(m, t) for m, ts in inner.items() for layer, above in ABOVE.items()
             if m == layer or m.startswith(layer + ".") for t in ts if t.startswith(above)]
    assert wrong == []


def test_the_tree_core_imports_the_standard_library_alone():
    mods = modules()
    _, outer = imports(mods)
    tree = {m: names for m, names in outer.items() if m == "uniradix.tree" or m.startswith("uniradix.tree.")}
    assert tree and all(names <= set(sys.stdlib_module_names) | {"__future__"} for names in tree.values()), tree


def test_every_test_directory_has_its_area():
    """`-m tree`, `-m engine`...: conftest's AREAS names where each area's tests live; a
    new directory of tests must say its area (else they all land in `project`)."""
    import importlib.util
    tests = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("tests_root_conftest", tests / "conftest.py")
    root = importlib.util.module_from_spec(spec)  # by its path: "conftest" alone may name another directory's
    spec.loader.exec_module(root)
    AREAS = root.AREAS
    assert all((tests / where).exists() for where in AREAS)
    dirs = {p.parent.relative_to(tests).parts[0] for p in tests.rglob("test_*.py") if p.parent != tests}
    assert dirs <= set(AREAS), sorted(dirs - set(AREAS))
