"""The cached forward over a batch: requests bring the pages and the state they reuse,
and new tokens; KV of the new tokens is written into the pools, attention reads cached
plus new (SWA only its window), and the recurrent state advances in its own slot.

The batch's tokens go through the projections, norms and MLPs together; attention and
the recurrent scan run per request, each over its own pages and slot."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import HybridConfig
from .layers import attend, matmul, mlp, recurrent_mix, rms_norm, rope


@dataclass
class PagedInput:
    """One request's step. `start` tokens are already in its pages and state; `tokens`
    are new, at positions start, start+1, ... `pages[name]` holds, for each KV
    component the model's attention layers read, one page handle per page of
    [0, start + len(tokens)) (-1 where a page is absent: only the pages from the first
    key `start` reads on must be there, which is what the tree hands out on resuming).
    `state_slot` holds the recurrent state at `start` and is advanced in place.
    `capture` maps positions in (start, end] to slots that receive a copy of the
    recurrent state there (checkpoints). `logit_rows`: how many of the last new tokens
    get logits; the LM head (a vocabulary-wide matmul per row) runs only on those. None:
    every new token (the oracle's view); an engine asks for 1 on the row it samples and
    0 for a prefill chunk that does not reach the end of the request's tokens.
    `greedy`: the rows' logits are only argmaxed (greedy sampling, no logprobs, none
    recorded), so a model may answer with each row's argmax token instead (a 1-D int64
    tensor: the token torch.argmax picks over the logits, bit for bit)."""

    tokens: list[int]
    start: int
    pages: dict = field(default_factory=dict)
    state_slot: int | None = None
    capture: dict[int, int] = field(default_factory=dict)
    logit_rows: int | None = None
    greedy: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def n_logits(self) -> int:
        """How many rows of logits this request gets (checked: 0 to len(tokens))."""
        k = self.logit_rows
        if k is None:
            return len(self.tokens)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= len(self.tokens):
            raise ValueError(f"logit_rows must be None or an int from 0 to {len(self.tokens)} (the new tokens), "
                             f"got {k!r}")
        return k


def head_rows(inputs: list[PagedInput], device) -> tuple[torch.Tensor | None, list[int]]:
    """The flat batch rows the LM head runs on (the last `n_logits` of each request's
    rows; None: every row, no gather needed), and how many each request gets. Every
    forward gathers these rows before its final norm and head, so a prefill chunk's
    discarded rows never reach the vocabulary-wide matmul."""
    counts = [i.n_logits for i in inputs]
    lens = [len(i.tokens) for i in inputs]
    if counts == lens:
        return None, counts
    rows, end = [], 0
    for n, k in zip(lens, counts):
        end += n
        rows.extend(range(end - k, end))
    return torch.as_tensor(rows, dtype=torch.long, device=device), counts


class _Span:
    """Where one request's K/V lives for one attention kind: the pages of [lo, end),
    the offset of lo in the first page, and each new token's page and offset."""

    __slots__ = ("idx", "off", "lo", "k_pos", "w_page", "w_off")

    def __init__(self, pages, P: int, lo: int, start: int, end: int, device) -> None:
        first, last = lo // P, -(-end // P)
        window = list(pages[first:last])
        if len(window) < last - first or min(window, default=0) < 0:
            raise ValueError(f"a page needed for positions [{lo}, {end}) is absent")
        self.idx = torch.as_tensor(window, dtype=torch.long, device=device)
        self.off = lo - first * P
        self.lo = lo
        self.k_pos = torch.arange(lo, end, device=device)
        new = range(start, end)
        self.w_page = torch.as_tensor([pages[p // P] for p in new], dtype=torch.long, device=device)
        self.w_off = torch.as_tensor([p % P for p in new], dtype=torch.long, device=device)


@torch.no_grad()
def paged_forward(cfg: HybridConfig, weights: dict, pools: dict, inputs: list[PagedInput], *,
                  wait_layer: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Logits [n_logits, vocab] per request (its last `logit_rows` new tokens; every one
    by default). pools: by component name, each holding
    the layers that keep that state (KVPools keyed by model layer index, a
    MambaStatePool), as the model's layer states say. `wait_layer(layer)` is called
    before a layer touches any pool data, so a layerwise load from the host tier only
    has to have finished that layer."""
    if not inputs:
        return []
    device = weights["embed"].device
    lens = [len(i.tokens) for i in inputs]
    if min(lens) <= 0:
        raise ValueError("every request in a batch brings at least one new token")
    rows, counts = head_rows(inputs, device)  # checked before any pool is written
    ids = torch.as_tensor([t for i in inputs for t in i.tokens], dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(i.start, i.end, device=device) for i in inputs])
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    N = bounds[-1]
    H, hd = cfg.n_heads, cfg.head_dim
    layers = [(cfg.attention(kind), cfg.recurrent(kind)) for kind in cfg.pattern]
    spans = {}  # per KV component: where each request's keys live
    for spec, _ in layers:
        if spec is not None and spec.name not in spans:
            P = pools[spec.name].page_size
            # from the first key the first new token reads (the same rule the tree resumes by)
            spans[spec.name] = [_Span(i.pages[spec.name], P, max(0, spec.first_key(i.start)), i.start, i.end,
                                      device) for i in inputs]
    x = weights["embed"][ids]
    commits: list = []  # recurrent states, written to their slots once every layer has run
    for layer, ((attn, rec), lw) in enumerate(zip(layers, weights["layers"])):
        if wait_layer is not None:
            wait_layer(layer)
        if attn is not None or rec is not None:  # else MLP only
            h = rms_norm(x, lw["norm1"], cfg.norm_eps)
            delta = 0
            if attn is not None:
                out = _attention(cfg, lw, pools[attn.name], layer, h, pos, spans[attn.name], inputs, bounds,
                                 attn.window)
                delta = matmul(out.reshape(N, H * hd), lw["wo"])
            if rec is not None:
                mp = pools[rec.name]
                outs = [_recurrent(cfg, lw, mp, layer, h[bounds[r]:bounds[r + 1]], inp, commits)
                        for r, inp in enumerate(inputs)]
                delta = delta + torch.cat(outs)
            x = x + delta
        x = x + mlp(rms_norm(x, lw["norm2"], cfg.norm_eps), lw)
    if rows is not None:
        x = x.index_select(0, rows)
    logits = matmul(rms_norm(x, weights["norm_f"], cfg.norm_eps), weights["head"])
    # only now does any request's recurrent state advance: a forward that fails part way
    # leaves every state as it was, so the step can be rerun (its KV writes are idempotent)
    for mp, layer, slot, conv, ssm in commits:
        mp.conv(layer)[slot] = conv
        mp.state(layer)[slot] = ssm
    return list(logits.split(counts))


def _attention(cfg, lw, pool, layer: int, h, pos, spans, inputs, bounds, window) -> torch.Tensor:
    """Write the new tokens' K/V into each request's pages, then attend over what each
    reads (its window, or the whole prefix)."""
    N, H, KV, hd = h.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = rope(matmul(h, lw["wq"]).view(N, H, hd), pos, cfg.rope_theta)
    k = rope(matmul(h, lw["wk"]).view(N, KV, hd), pos, cfg.rope_theta)
    v = matmul(h, lw["wv"]).view(N, KV, hd)
    kp, vp = pool.k(layer), pool.v(layer)
    out = torch.empty_like(q)
    for r, sp in enumerate(spans):
        a, b = bounds[r], bounds[r + 1]
        kp[sp.w_page, sp.w_off] = k[a:b]
        vp[sp.w_page, sp.w_off] = v[a:b]
        n = b - a + inputs[r].start - sp.lo
        keys = kp[sp.idx].flatten(0, 1)[sp.off:sp.off + n]
        vals = vp[sp.idx].flatten(0, 1)[sp.off:sp.off + n]
        out[a:b] = attend(q[a:b], keys, vals, pos[a:b], sp.k_pos, window)
    return out


def _recurrent(cfg, lw, mp, layer: int, h: torch.Tensor, inp: PagedInput, commits: list) -> torch.Tensor:
    """Advance one request's state over its new tokens; the states to write (its own
    slot's, and copies at captures) go to `commits`. Each (layer, slot) is read once and
    written once per forward, so deferring the writes changes nothing a layer reads."""
    s, T = inp.start, h.shape[0]
    conv, ssm = mp.conv(layer)[inp.state_slot], mp.state(layer)[inp.state_slot]
    cuts = sorted(p - s for p in inp.capture if s < p <= s + T)
    outs, a = [], 0
    for b in cuts + [T]:
        if b > a:
            o, conv, ssm = recurrent_mix(h[a:b], lw, conv, ssm, cfg.n_heads, cfg.head_dim, cfg.state_dim)
            outs.append(o)
        slot = inp.capture.get(s + b)
        if slot is not None:
            commits.append((mp, layer, slot, conv, ssm))
        a = b
    commits.append((mp, layer, inp.state_slot, conv, ssm))
    return torch.cat(outs)
