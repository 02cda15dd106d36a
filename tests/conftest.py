"""Test-wide settings. The model's tensors are tiny: one torch thread computes them as
fast as two, and does not spin against the other process on a loaded 2-core machine
(which made the model and engine suites 20x slower under load)."""
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _fingerprint_cache(tmp_path_factory):
    """Weight fingerprints are cached on disk (uniradix.model.fingerprint): the tests
    keep theirs in a directory of their own, not in the user's ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("UNIRADIX_CACHE_DIR", str(tmp_path_factory.mktemp("fingerprints")))
    yield
    mp.undo()



# --------------------------------------------------------------------------- engines
# Every engine a test makes through `make_engine` is checked when the test ends: nothing
# left running or locked, every allocated handle owned by the tree (no leak), and a
# flush gives every handle back to its pool (tests/engine/engine_checks.py).
sys.path.insert(0, str(Path(__file__).resolve().parent / "engine"))
import engine_checks as ec  # noqa: E402


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def make_engine(request):
    made = []

    def make(config="tiny-hybrid", **kw) -> ec.Engine:
        eng = ec.Engine(config, **kw)
        made.append(eng)
        return eng

    yield make
    rep = getattr(request.node, "rep_call", None)
    if rep is None or not rep.passed:
        return  # the test's own failure says what went wrong
    for eng in made:
        ec.check_settled(eng)
        ec.check_flush(eng)


#: each test's area, from where it lives: `python -m pytest -q -m tree` (or engine, tiers,
#: server, models, bench, cache, project) runs one area's tests, for someone who changed it
AREAS = {"tree": "tree", "engine": "engine", "memory": "tiers", "hicache": "tiers", "test_cache_host.py": "tiers",
         "server": "server", "model": "models", "bench": "bench", "test_cache.py": "cache",
         "test_cache_stateful.py": "cache"}


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parent
    for item in items:
        first = Path(item.fspath).resolve().relative_to(root).parts[0]
        item.add_marker(getattr(pytest.mark, AREAS.get(first, "project")))
