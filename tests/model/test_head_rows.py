"""The LM head runs only on the rows that are sampled (issue 17, item 1): the last row of
a chunk that reaches the end of its request's tokens (the prompt's last, or a decode
token); a prefill chunk short of the end gets no logits. Checked by counting the rows
that reach the head, per forward, for the embedded model and every Hugging Face family,
in batches that mix finishing and unfinished prefill chunks with decode rows; and, for
the families, the rows their last layer goes on with past its attention or mixer (the
same rows: the other rows' KV and states are written, and nothing after them is
computed), with every logit exact."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from uniradix.engine.build import build_cache
from uniradix.model import PagedInput, ReferenceModel, paged
from uniradix.model.config import preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "hf"))
from engine_checks import check_exact, greedy, run_checked  # noqa: E402


def count_embedded_head(monkeypatch, model: ReferenceModel) -> list[int]:
    """Rows per forward that reach the embedded model's final norm (and so its head)."""
    seen: list[int] = []
    norm = paged.rms_norm

    def counting(x, w, eps):
        if w is model.weights["norm_f"]:
            seen.append(x.shape[0])
        return norm(x, w, eps)
    monkeypatch.setattr(paged, "rms_norm", counting)
    return seen


def count_family_head(model) -> list[int]:
    """Rows per forward that reach a Hugging Face family's `head`."""
    seen: list[int] = []
    head = model.head

    def counting(x):
        seen.append(x.shape[0])
        return head(x)
    model.head = counting
    return seen


def count_family_last_layer(model) -> list[int]:
    """Rows per forward that a Hugging Face family's last layer hands on (its attention
    or mixer writes every row's KV and state; the rest of it runs on these), checking
    that every other layer hands on every row."""
    seen: list[int] = []
    block, last = model.block, len(model.kinds) - 1

    def counting(i, x, batch):
        out = block(i, x, batch)
        if i == last:
            seen.append(out.shape[0])
        else:
            assert out.shape[0] == x.shape[0] == len(batch.ids)
        return out
    model.block = counting
    return seen


def expect_sampled_rows(engine) -> list[int]:
    """Wraps the engine's forward: per call, the rows the head should see, i.e. the
    inputs whose chunk ends at the end of their request's tokens (found by their pages,
    which the request state hands over as they are)."""
    want: list[int] = []
    model = engine.model
    forward = model.forward

    def recording(pools, inputs, wait_layer=None):
        owners = [next(st for st in engine.running if st.pages is inp.pages) for inp in inputs]
        want.append(sum(inp.end == len(st.tokens) for inp, st in zip(inputs, owners)))
        return forward(pools, inputs, wait_layer=wait_layer)
    model.forward = recording
    return want


def run_mixed(make_engine, model, vocab: int):
    """Three requests whose prompts take several chunks of 7 tokens while the others
    decode, then a turn that reuses the first: every kind of row in shared batches."""
    rng = random.Random(7)
    eng = make_engine(model, page_size=4, max_total_tokens=1024, chunked_prefill_size=7)
    want = expect_sampled_rows(eng)
    reqs = [greedy([rng.randrange(8, vocab) for _ in range(n)], 5) for n in (3, 17, 23)]
    run_checked(eng, reqs)
    nxt = greedy(reqs[1].input_ids + reqs[1].output_ids + [rng.randrange(8, vocab) for _ in range(11)], 4)
    run_checked(eng, [nxt])
    reqs.append(nxt)
    del model.forward  # the class's own again, for the oracle (check_exact)
    return eng, reqs, want


def check_rows(eng, reqs, want: list[int], seen: list[int]) -> None:
    computed = eng.counters["prefill_tokens"] + eng.counters["decode_tokens"]
    assert seen == want, (seen, want)
    assert sum(seen) == sum(len(r.output_ids) for r in reqs)  # one head row per sampled token
    assert 0 in seen and sum(seen) < computed  # steps of unfinished chunks only, and rows skipped
    for r in reqs:
        check_exact(eng, r)


def test_embedded_head_runs_only_on_sampled_rows(make_engine, monkeypatch):
    model = ReferenceModel("tiny-hybrid")
    seen = count_embedded_head(monkeypatch, model)
    eng, reqs, want = run_mixed(make_engine, model, 256)
    check_rows(eng, reqs, want, seen)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3_next", "gpt_oss", "granite_hybrid", "nemotron_h"])
def test_family_head_runs_only_on_sampled_rows(make_engine, tmp_path, family):
    pytest.importorskip("transformers")
    from harness import V, make_tiny
    from uniradix.model.hf import load_checkpoint
    model = load_checkpoint(make_tiny(family, str(tmp_path / family)))
    seen, last = count_family_head(model), count_family_last_layer(model)
    eng, reqs, want = run_mixed(make_engine, model, V)
    del model.head, model.block
    assert last == want, (last, want)   # the last layer goes on with the sampled rows only
    check_rows(eng, reqs, want, seen)


def _pools(model, n: int):
    cache, pools = build_cache(model, page_size=1, max_total_tokens=n + 1, max_mamba_cache_size=4)
    pages = {name: pools[name].alloc(n) for name in pools if hasattr(pools[name], "page_size")}
    slot = None
    if cache.ckpt is not None:
        mp = cache.pools[cache.ckpt.index]
        slot = mp.alloc(1)[0]
        mp.zero_slots([slot])
    return pools, pages, slot


def test_logit_rows_selects_the_last_rows_of_each_request():
    """A batch of requests asking for every row, the last two, the last one and none:
    each gets exactly those rows of the full forward's logits."""
    model = ReferenceModel(preset("full-only"))
    rng = random.Random(3)
    seqs = [[rng.randrange(256) for _ in range(n)] for n in (5, 6, 4, 3)]
    full = [model.reference(s) for s in seqs]
    inputs, at = [], 0
    pools, pages, _ = _pools(model, sum(map(len, seqs)))
    for s, k in zip(seqs, (None, 2, 1, 0)):
        mine = {name: handles[at:at + len(s)] for name, handles in pages.items()}
        inputs.append(PagedInput(s, 0, mine, None, logit_rows=k))
        at += len(s)
    out = model.forward(pools, inputs)
    assert [o.shape[0] for o in out] == [5, 2, 1, 0]
    for o, ref in zip(out, full):
        if o.shape[0]:
            assert (o - ref[-o.shape[0]:]).abs().max().item() < 1e-4
    assert out[3].shape == (0, model.vocab_size)


@pytest.mark.parametrize("bad", [-1, 4, True, 1.0])
def test_a_bad_logit_rows_is_refused_before_any_work(bad):
    model = ReferenceModel("tiny-hybrid")
    pools, pages, slot = _pools(model, 3)
    before = {name: [t.clone() for t in pools[name].handle_tensors()] for name in pools}
    with pytest.raises(ValueError, match="logit_rows"):
        model.forward(pools, [PagedInput([1, 2, 3], 0, pages, slot, logit_rows=bad)])
    for name, ts in before.items():
        assert all(torch.equal(a, b) for a, b in zip(ts, pools[name].handle_tensors()))
