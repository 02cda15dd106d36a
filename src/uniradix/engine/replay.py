"""Replaying served traffic on the real scheduler and cache with nothing computed: a
model that keeps a real model's layers (so the same components, windows, checkpoints
and pool sizes) but returns empty logits, pools that only count, and an engine that
takes each request's logged output tokens instead of sampling. What the cache reuses
depends on the tokens and on the order the scheduler sees them, never on the values
computed, so a replay reuses what the server reused (`uniradix simulate`)."""
from __future__ import annotations

import torch

from ..model import PagedModel, load_model
from .engine import Engine
from .request import Request, SamplingParams


class ReplayModel(PagedModel):
    """`model`'s layer list, vocabulary, context and tokenizer, and a forward that reads
    and writes nothing: each input gets `n_logits` empty rows."""

    name = "replay"

    def __init__(self, model: PagedModel) -> None:
        self.inner = model
        self.name = f"replay of {model.name}"
        self.config = model.config
        self.weights = {}
        self.tokenizer = model.tokenizer
        self.eos_token_ids = model.eos_token_ids
        self._states = model.states()

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def context_length(self) -> int | None:
        return self.inner.context_length

    def states(self):
        return self._states

    def computation(self) -> dict:
        return self.inner.computation()

    def forward(self, pools, inputs, wait_layer=None):
        return [torch.empty((inp.n_logits, 0)) for inp in inputs]

    def to(self, device) -> "ReplayModel":
        return self


class ReplayEngine(Engine):
    """An Engine over a ReplayModel and accounting-only pools. `replay(input_ids,
    output_ids, ...)` makes a request that generates exactly `output_ids`."""

    def __init__(self, model="tiny-hybrid", config=None, **kw) -> None:
        inner = model if isinstance(model, PagedModel) else load_model(model)
        super().__init__(model if isinstance(model, ReplayModel) else ReplayModel(inner), config,
                         accounting_only=True, **kw)
        self._outputs: dict[int, list[int]] = {}

    def replay(self, input_ids, output_ids, *, session_id=None, salt=None, priority=None,
               prompt_logprobs_from=None) -> Request:
        if not output_ids:
            raise ValueError("a replayed request needs the output tokens it generated (at least one)")
        req = Request(input_ids=list(input_ids), session_id=session_id, salt=salt, priority=priority,
                      prompt_logprobs_from=prompt_logprobs_from,
                      sampling=SamplingParams(max_new_tokens=len(output_ids)))
        self._outputs[req.rid] = list(output_ids)
        return req

    def _choose(self, st, row) -> int:
        req = st.owner
        out = self._outputs[req.rid]
        tok = out[len(req.output_ids)]
        if len(req.output_ids) + 1 == len(out):
            del self._outputs[req.rid]
        return tok

    def _logprobs(self, row, token, top):
        return None  # nothing was computed; the position still counts as scored
