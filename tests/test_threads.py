"""`--num-threads` (issue 17, item 4): `uniradix run` and `serve` apply it to torch
before the model loads and say so at start-up; without it $OMP_NUM_THREADS counts, as
users expect, else one thread; a bad value is refused with the flag's (or the
variable's) name."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from uniradix.cli import main

TINY_RUN = ["run", "--clients", "1", "--rounds", "1", "--tokens-per-round", "8", "--output-tokens", "2",
            "--shared-prefix-tokens", "0", "--no-progress"]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_flag_wins_then_the_variable_then_the_default():
    from uniradix.threads import DEFAULT_THREADS, resolve_threads
    assert resolve_threads(3, {"OMP_NUM_THREADS": "2"}) == (3, "--num-threads")
    assert resolve_threads(None, {"OMP_NUM_THREADS": "2"}) == (2, "$OMP_NUM_THREADS")
    assert resolve_threads(None, {"OMP_NUM_THREADS": " 4,2 "}) == (4, "$OMP_NUM_THREADS")  # OpenMP's nested list
    assert resolve_threads(None, {"OMP_NUM_THREADS": ""}) == (DEFAULT_THREADS, "the default")
    assert resolve_threads(None, {}) == (DEFAULT_THREADS, "the default")
    assert DEFAULT_THREADS == 1


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_a_bad_variable_is_refused_by_name(bad):
    from uniradix.threads import resolve_threads
    with pytest.raises(ValueError, match=r"\$OMP_NUM_THREADS must be a positive integer"):
        resolve_threads(None, {"OMP_NUM_THREADS": bad})


def test_run_applies_and_prints_the_flag(monkeypatch, capsys, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    assert main([*TINY_RUN, "--num-threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("uniradix run:") and "2 compute threads (--num-threads;" in header, header


def test_run_honours_omp_num_threads(monkeypatch, capsys, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(1)
    assert main(TINY_RUN) == 0
    assert torch.get_num_threads() == 2
    assert "2 compute threads ($OMP_NUM_THREADS;" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["0", "-2"])
def test_run_refuses_a_bad_count(bad, capsys, restore_threads):
    torch.set_num_threads(1)
    assert main([*TINY_RUN, "--num-threads", bad]) == 2
    assert f"--num-threads must be a positive integer, got {bad}" in capsys.readouterr().err
    assert torch.get_num_threads() == 1


def test_run_refuses_what_is_not_a_number(capsys):
    with pytest.raises(SystemExit) as e:
        main([*TINY_RUN, "--num-threads", "all"])
    assert e.value.code == 2
    assert "--num-threads: 'all' is not an int" in capsys.readouterr().err


def test_run_refuses_a_bad_variable(monkeypatch, capsys, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    assert main(TINY_RUN) == 2
    assert "$OMP_NUM_THREADS must be a positive integer, got 'many'" in capsys.readouterr().err


def test_serve_applies_and_logs_the_flag():
    sys.path.insert(0, str(Path(__file__).resolve().parent / "server"))
    from server_proc import ServerProc
    srv = ServerProc("--num-threads", "2")
    try:
        status, info, _ = srv.request("GET", "/get_server_info")
        assert status == 200 and info["num_threads"] == 2, info
    finally:
        assert srv.stop() == 0
    log = "".join(srv.lines)
    assert "2 compute threads (--num-threads;" in log, log
