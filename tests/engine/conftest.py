"""Every engine a test makes through `make_engine` is checked when the test ends:
nothing left running or locked, every allocated handle owned by the tree (no leak),
and a flush gives every handle back to its pool."""
from __future__ import annotations

import pytest

import engine_checks as ec


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
