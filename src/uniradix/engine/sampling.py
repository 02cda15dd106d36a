"""Next-token choice from one row of logits: greedy, temperature and top-p."""
from __future__ import annotations

import torch

from ..model import kernels
from .request import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise a draw from `distribution`, with the request's
    own generator. An int64 "row" is the token the model's greedy head already picked
    (PagedInput.greedy: only for greedy requests)."""
    if logits.dtype is torch.int64:
        return int(logits)
    if params.temperature == 0:
        if logits.dtype is torch.float32 and logits.dim() == 1 and logits.device.type == "cpu" and kernels.available():
            return kernels.argmax(logits)
        return int(torch.argmax(logits))
    return int(torch.multinomial(distribution(logits, params).cpu(), 1, generator=generator))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a sampled request draws from (float64, proportional: after top_p the mass
    kept sums to less than 1, and torch.multinomial normalises): the top_k likeliest
    tokens, then the smallest set of those whose probability at the temperature reaches
    top_p."""
    logits = logits.double()
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1:
        p, order = probs.sort(descending=True)
        keep = p.cumsum(-1) - p < params.top_p  # a token is kept if the mass before it is short of top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], p[keep])
    return probs


def accept_draft(logits: torch.Tensor, params: SamplingParams, draft: int | None,
                 generator: torch.Generator | None) -> tuple[int, bool]:
    """A sampled request's token at a verify row, and whether it is the draft: a
    deterministic draft d is kept with probability p(d), else the token is drawn from p
    with d taken out (renormalised), so the token's distribution is p whatever the draft
    (speculative sampling with a draft distribution that puts all its mass on d). With
    no draft (the row after the last one), a plain draw from p."""
    probs = distribution(logits, params).cpu()
    probs /= probs.sum()
    if draft is None:
        return int(torch.multinomial(probs, 1, generator=generator)), False
    p = float(probs[draft])
    if p > 0 and float(torch.rand((), dtype=torch.float64, generator=generator)) < p:
        return draft, True
    probs[draft] = 0.0
    return int(torch.multinomial(probs, 1, generator=generator)), False


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list]:
    """The log probability of `token` under one row of logits (log-softmax in float32:
    the raw distribution, before temperature and truncation) and the `top` likeliest
    tokens with theirs, likeliest first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    alternatives = []
    if top:
        values, ids = torch.topk(lp, top)
        alternatives = list(zip(ids.tolist(), values.tolist()))
    return float(lp[token]), alternatives
