"""The greedy head (kernels.GreedyHead): a greedy row's token from an int8 copy of the LM
head and bounds on every logit, then the few words the bounds cannot rule out computed
exactly: always the full head's argmax, the first of equal values, in every dtype, with
an order-keeping finish, on rows built to be near ties; a row it cannot decide (not
finite, too many candidates) is handed back for the full head."""
from __future__ import annotations

import os

import pytest
import torch

from uniradix.model import kernels

pytestmark = pytest.mark.skipif(os.environ.get("UNIRADIX_KERNELS", "").lower() == "torch" or not kernels.available(),
                                reason="the row-invariant kernels are not built here")


def _full(x, head, finish=None):
    logits = kernels.linear(x, head)
    if finish is not None:
        logits = finish(logits)
    return [kernels.argmax(r.contiguous()) for r in logits.float()]


def _rows(W: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Rows whose two best words are near ties, a few millionths apart, zero at the
    outlier input: half of them plain, half leaning along the difference of what an int8
    copy with a scale a word rounds away from the two words (so that copy misjudges
    their order by about a quarter, against the millionths that decide it); and plain
    random rows."""
    V, K = W.shape
    W = W.double().clone()
    scale = (W.abs().amax(1, keepdim=True) / 127).float().double()
    rounded_away = W - scale * torch.round(W / scale)
    W[:, 3] = rounded_away[:, 3] = 0                  # rows that read nothing of the outlier input
    out = []
    for i in range(160):
        a, b = torch.randint(0, V, (2,), generator=g).tolist()
        if a == b:
            continue
        wa, wb = W[a], W[b]
        d = rounded_away[a] - rounded_away[b]
        lean = (0.25 / (d @ d)).item() if i % 2 else 0.0
        c = 20.0
        eps = (torch.rand((), generator=g, dtype=torch.float64).item() - 0.5) * 1e-5
        # x = c (wa + wb) + t (wa - wb) + lean d, with logit_a - logit_b = eps
        t = (eps - c * (wa @ wa - wb @ wb) - lean * (d @ (wa - wb))) / ((wa - wb) @ (wa - wb))
        out.append(c * (wa + wb) + t * (wa - wb) + lean * d)
    plain = torch.randn(40, K, generator=g, dtype=torch.float64) * 3
    return torch.cat([torch.stack(out), plain]).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_the_greedy_head_picks_the_full_heads_argmax(dtype, scaled):
    g = torch.Generator().manual_seed(7)
    V, K = 1013, 70                                   # a padded last panel; inputs not a multiple of 4
    W = torch.randn(V, K, generator=g) * 0.05
    W[:, 3] *= 30                                     # an outlier input: each word's int8 scale is coarse for the rest
    W[500] = W[20]                                    # equal words: the first wins
    W[1012] = W[20]
    W = W.to(dtype)
    head = kernels.PackedWeight(W)
    gh = kernels.GreedyHead(head)
    finish = (lambda t: t / 3.0) if scaled else None  # a finish that keeps the order (Granite's scaling)
    x = _rows(W.float(), g)
    x[0] = W[20].float() * 40                         # its best word is the tied one
    x[0, 3] = 0
    x[1] = 0                                          # every logit zero: word 0
    x = x.to(dtype)
    want = _full(x, head, finish)
    got = [gh.argmax(x[i:i + 1], finish)[0] for i in range(len(x))]   # alone: only its own candidates computed
    assert gh.argmax(x[:40], finish) == got[:40]      # together: the same
    for n in (2, 9, 10, 17):                          # rows in blocks (17: 8, 5, 4; 10: 8, 2): the same candidates
        together = gh.candidates(x[:n], dtype)
        for i in range(n):
            alone = gh.candidates(x[i:i + 1], dtype)[0]
            assert (alone is None and together[i] is None) or torch.equal(alone, together[i]), (n, i)
    assert got[0] == want[0] == 20 and got[1] == want[1] == 0
    assert all(t is None or t == w for t, w in zip(got, want)), [(i, t, w) for i, (t, w) in enumerate(zip(got, want))
                                                                  if t is not None and t != w]
    decided = sum(t is not None for t in got)
    assert decided >= len(got) - 2                    # the bound decides nearly every row...
    sizes = sorted(len(c) for c in gh.candidates(x, dtype if dtype is not torch.float32 else dtype) if c is not None)
    assert sizes[len(sizes) // 2] <= 16               # ...from a handful of exact words


def test_a_row_the_greedy_head_cannot_decide_goes_to_the_full_head():
    torch.manual_seed(3)
    W = torch.randn(300, 64) * 0.05
    gh = kernels.GreedyHead(kernels.PackedWeight(W), cap=4)
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    x[2] = 0                                          # 300 equal logits: more candidates than the cap
    got = gh.argmax(x)
    assert got[0] == _full(x[:1], kernels.PackedWeight(W))[0]
    assert got[1] is None and got[2] is None


def test_rows_the_bound_leaves_unwritten_go_to_the_full_head(monkeypatch):
    """A row whose count the candidates call does not write (decode_step's glue pass makes
    every call into the C library a no-op) is handed back, not read as garbage panels."""
    gh = kernels.GreedyHead(kernels.PackedWeight(torch.randn(300, 64)))
    monkeypatch.setattr(kernels.lib(), "ur_greedy_candidates", lambda *args: 0)
    assert gh.argmax(torch.randn(5, 64)) == [None] * 5


def test_the_greedy_head_reads_half_a_bfloat16_heads_bytes():
    W = torch.randn(4096, 256).bfloat16()
    head = kernels.PackedWeight(W)
    gh = kernels.GreedyHead(head)
    assert gh.codes.numel() == 4096 * 256
    assert gh.nbytes() < head.nbytes() * 0.55          # int8 codes and four floats a word


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_logits_that_round_to_one_value_take_the_first_word(dtype):
    """Two words whose float32 sums differ but round to one 16-bit value tie, and the
    first wins, though its sum is the smaller. Here the int8 copy is exact (every weight
    a multiple of 1/64 up to 127/64, the row whole numbers up to 127), so the bounds
    are tight and only the bar's allowance for the rounding keeps the first word."""
    K = 32
    W = torch.zeros(40, K)
    W[:, 0] = 127
    W[20, 1], W[20, K - 1] = 4, 5                     # sums 260.03 (word 20) and 259.95 (word 2): one 16-bit value
    W[2, 1] = 4
    W = (W / 64).to(dtype)
    x = torch.full((1, K), 127.0)
    x[0, K - 1] = 1
    x = x.to(dtype)
    head = kernels.PackedWeight(W)
    sums = kernels.linear(x, head, dtype=torch.float32)[0]
    assert sums[2] < sums[20] and sums.to(dtype)[2] == sums.to(dtype)[20]   # in two panels
    assert _full(x, head) == [2]
    assert kernels.GreedyHead(head).argmax(x) == [2]


def test_a_last_panels_padding_never_sets_the_bar():
    """Every logit well below zero and a vocabulary that leaves a last panel part empty:
    the padding's words (zero codes, bounds about zero) must not count as the best lower
    bound, which would leave every real word below the bar."""
    g = torch.Generator().manual_seed(11)
    W = -(torch.rand(45, 64, generator=g) + 0.5)      # 45 words: the third panel holds 13
    x = torch.rand(6, 64, generator=g) + 0.5          # every logit about -32
    head = kernels.PackedWeight(W)
    gh = kernels.GreedyHead(head)
    assert gh.argmax(x) == _full(x, head)
    assert all(c is not None and 0 < len(c) < 45 for c in gh.candidates(x, torch.float32))


def test_words_kept_on_the_way_give_the_candidates_of_the_final_bar():
    """Logits that rise word after word: every word passes the bar of the best lower bound
    seen before it, so the pass keeps more words than its room (4 cap + 4096) and must drop
    those a later bar rules out as it goes, keeping the ones it cannot (word 100: an
    outlier weight on an input the row does not read makes its bound wide, so it stays a
    candidate to the end). The candidates are then exactly those of a pass with room for
    every word: word 100 and the six tied best words at the end, none of the rest."""
    g = torch.Generator().manual_seed(5)
    V, K = 20003, 64
    u = torch.randn(K, generator=g)
    u[3] = 0
    W = (1 + torch.arange(V, dtype=torch.float32) / V)[:, None] * u   # logits x.u (1 + j / V): rising
    W[100] = 2.2 * u
    W[100, 3] = 1000.0                                                # its int8 copy coarse: a wide bound
    W[V - 6:] = 2.5 * u                                               # the best, six equal words
    x = u[None, :].clone()
    head = kernels.PackedWeight(W)
    small, roomy = kernels.GreedyHead(head, cap=8), kernels.GreedyHead(head, cap=8192)
    assert 4 * small.cap + 4096 < V < 4 * roomy.cap + 4096
    kept = small.candidates(x, torch.float32)[0]
    assert kept is not None and torch.equal(kept, roomy.candidates(x, torch.float32)[0])
    assert kept.tolist() == [100] + list(range(V - 6, V))
    assert small.argmax(x) == _full(x, head) == [V - 6]
