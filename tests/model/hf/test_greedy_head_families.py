"""The greedy head in every family's engine (model/hf/family.py, kernels.GreedyHead): with
it on, greedy requests get their tokens from the int8 bound and a few exact words, and
every reply is the same as with the full head, with speculation on and off, in float32
and bfloat16, beside a request whose logprobs need the full logits in the same batch and
prefill chunks that need none."""
import functools
import random

import pytest
import torch

from harness import SPECULATE, TINY, V, make_tiny, speculating
from uniradix.engine import Engine, Request, SamplingParams
from uniradix.model import kernels
from uniradix.model.hf import family as hf_family, load_checkpoint

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the row-invariant kernels are not built here")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Each family's tiny checkpoint, made on first use."""
    root = tmp_path_factory.mktemp("greedy")
    return functools.cache(lambda family: make_tiny(family, str(root / family)))


def _requests(seed: int) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(8, V) for _ in range(18)]
    reqs = [Request(input_ids=shared + [rng.randrange(8, V) for _ in range(rng.randrange(1, 9))],
                    sampling=SamplingParams(max_new_tokens=10)) for _ in range(4)]
    reqs.append(Request(input_ids=shared + [9, 10], sampling=SamplingParams(max_new_tokens=6), logprobs=2))
    return reqs


def _serve(model, speculate: bool) -> list[list[int]]:
    kw = SPECULATE if speculate else {}
    eng = Engine(model, page_size=4, max_total_tokens=1024, chunked_prefill_size=5, **kw)   # chunks with no logits
    if speculate:
        speculating(eng)
    try:
        reqs = _requests(5)
        eng.run(reqs[:2])
        eng.run(reqs[2:])   # a second batch resumes from the first's pages
        assert all(r.status == "finished" for r in reqs), [(r.status, r.error) for r in reqs]
        return [list(r.output_ids) for r in reqs]
    finally:
        eng.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", sorted(TINY))
def test_the_greedy_head_gives_every_familys_replies(tiny, family, dtype, monkeypatch):
    path = tiny(family)
    full = load_checkpoint(path, dtype, "none")
    monkeypatch.setattr(hf_family, "greedy_head_pays", lambda head: False)
    want = {s: _serve(full, s) for s in (False, True)}
    assert full._greedy is False
    monkeypatch.setattr(hf_family, "greedy_head_pays", lambda head: True)   # however small the head
    model = load_checkpoint(path, dtype, "none")
    calls = []
    argmax = kernels.GreedyHead.argmax
    monkeypatch.setattr(kernels.GreedyHead, "argmax", lambda self, x, finish=None: calls.append(len(x))
                        or argmax(self, x, finish))
    for speculate in (False, True):
        before = len(calls)
        assert _serve(model, speculate) == want[speculate]
        assert len(calls) > before                    # the greedy rows went through it
    assert isinstance(model.greedy_head(), kernels.GreedyHead)
    with kernels.off():                               # torch's kernels for everything, the head too
        assert model.greedy_head() is None
    assert max(calls) > 1                             # verify chunks and batches: several rows at once
