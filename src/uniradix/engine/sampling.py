"""Next-token choice from one row of logits: greedy, temperature and top-p."""
from __future__ import annotations

import torch

from .request import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise a draw from the smallest set of tokens whose
    probability reaches top_p, renormalised, with the request's own generator."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1:
        p, order = probs.sort(descending=True)
        keep = p.cumsum(-1) - p < params.top_p  # a token is kept if the mass before it is short of top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
