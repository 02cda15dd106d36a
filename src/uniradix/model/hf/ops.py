"""The paged building blocks every family's forward is made of: the one linear op every
projection goes through (dense weights in any dtype, quantized ones: quant.py), the
elementwise activations, norms and RoPE as the Hugging Face implementations compute
them, attention that writes new K/V into a component's pages and reads each request's
keys back from them, and a recurrent runner that advances each request's state in its
slot, copying it out at captures and committing only after the last layer.

Every op gives a row the same bits whatever rows are computed beside it (a decode step,
a prefill chunk of any size, the no-cache forward): products, activations, attention and
the recurrences through the row-invariant kernels (model/kernels) on the CPU; norms and
other reductions row by row over the last dimension (torch computes each row alone);
RoPE's cos and sin from a table made in fixed blocks of positions (torch's cos and sin
round a value differently in the vector body and the tail of a call, so a position's
value must not depend on which positions share its call).

A `Batch` holds one forward's requests: their tokens' positions, where each request's
rows sit in the flattened batch, the spans of pages each KV component reads, and the
recurrent states waiting to be committed."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import kernels
from ..paged import PagedInput
from .gemm import dense
from .quant import is_quantized


# ---------------------------------------------------------------------------- linear
def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T (+ b) in x's dtype, whatever form W [out, in] takes: a dense
    tensor (gemm.dense: in float32 where this CPU has no fast GEMM for its dtype), or a
    quantized weight (quant.py: bfloat16 activations, torch's packed kernels for few
    rows on the CPU)."""
    if is_quantized(w):
        y = w.linear(x)
        return y if b is None else y + b
    return dense(x, w, b)


def linears(x: torch.Tensor, ws: list, bs: list | None = None) -> list[torch.Tensor]:
    """[linear(x, w, b) for w, b in zip(ws, bs)] as one product where the weights can be
    one (kernels.fuse: packed alike, made once per set of weights and kept), each output
    a view of its columns; the same bits either way."""
    bs = bs or [None] * len(ws)
    fused = _fused(ws, bs) if _kernel(x) else None
    if fused is None:
        return [linear(x, w, b) for w, b in zip(ws, bs)]
    w, b, sizes = fused
    return list(linear(x, w, b).split(sizes, dim=-1))


_FUSED: dict = {}


def _fused(ws: list, bs: list):
    """(the fused weight, its bias, the parts' widths) for weights `ws` with biases `bs`,
    or None where they stay apart (kernels.fuse says no; some parts have a bias and some
    not: a zero bias would turn a -0.0 into 0.0). Keyed by the tensors themselves."""
    key = tuple(map(id, ws)) + tuple(map(id, bs))
    hit = _FUSED.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], (*ws, *bs))):
        if len(_FUSED) > 4096:  # weights of models long gone
            _FUSED.clear()
        has_bias = {b is not None for b in bs}
        fused = kernels.fuse(ws) if len(has_bias) == 1 else None
        if fused is not None:
            b = torch.cat([b.float() for b in bs]) if True in has_bias else None
            fused = (fused, b, [w.out_features for w in ws])
        hit = _FUSED[key] = ((*ws, *bs), fused)
    return hit[1]


# ---------------------------------------------------------------------------- activations
def _kernel(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and kernels.available()


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), computed in float32 and rounded to x's dtype."""
    return kernels.elementwise("silu", x) if _kernel(x) else F.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return kernels.elementwise("sigmoid", x) if _kernel(x) else torch.sigmoid(x)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """log(1 + e^x), x itself above `threshold` (torch's softplus, beta 1)."""
    return kernels.elementwise("softplus", x, threshold) if _kernel(x) else F.softplus(x, threshold=threshold)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (gelu_pytorch_tanh)."""
    return kernels.elementwise("gelu_tanh", x) if _kernel(x) else F.gelu(x, approximate="tanh")


_GATES = {"silu": silu, "gelu_tanh": gelu_tanh}


def gated(act: str, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """act(g) * u, a gated unit's product (SwiGLU: silu, GeGLU: gelu_tanh): one kernel call
    where g and u share a dtype and their rows' elements lie side by side (kernels.act_mul:
    the same bits as the two ops), else the two ops."""
    if _kernel(g):
        y = kernels.act_mul(act, g, u)
        if y is not None:
            return y
    return _GATES[act](g) * u


def tanh(x: torch.Tensor) -> torch.Tensor:
    return kernels.elementwise("tanh", x) if _kernel(x) else torch.tanh(x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return kernels.elementwise("exp", x) if _kernel(x) else torch.exp(x)


# ---------------------------------------------------------------------------- norms
def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, offset: float = 0.0,
             dtype: torch.dtype | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm in float32, scaled by (offset + w) (offset 1.0: Gemma's and Qwen3-Next's
    zero-centred weights), cast to `dtype` (default x's, or the residual's: the residual
    stream may be wider than the model's dtype, HFModel.residual_dtype): x / sqrt(mean(x^2)
    + eps) * scale, one kernel call (kernels.rms_norm; torch's rms_norm where the kernels
    are off, several ops and ~30 us a call: a decode step normalises ~100 times). With
    `residual`, residual + that (a sandwich norm's residual add), in the same call where
    the kernel takes the dtype."""
    scale = None if w is None else _norm_scale(w, offset)
    dtype = dtype or (x.dtype if residual is None else residual.dtype)
    if _kernel(x):
        if residual is not None and residual.dtype is dtype and dtype in (torch.float32, torch.bfloat16):
            return kernels.rms_norm(x, scale, eps, dtype, residual=residual.contiguous())
        y = kernels.rms_norm(x, scale, eps, dtype)
    else:
        y = F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(dtype)
    return y if residual is None else residual + y


def rms_norm_llama(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm as Llama-style models do it: normalised in float32, cast back (to
    `dtype`, default x's), then scaled by w in the weights' dtype."""
    if _kernel(x):
        return w * kernels.rms_norm(x, None, eps, dtype or x.dtype)
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(dtype or x.dtype)


_NORM_SCALES: dict = {}


def _norm_scale(w: torch.Tensor, offset: float) -> torch.Tensor:
    """(offset + w) in float32, made once per norm weight rather than at every call (a
    decode step normalises ~100 times); keyed by the tensor itself, so a weight moved or
    replaced gets its own."""
    key = (id(w), offset)
    hit = _NORM_SCALES.get(key)
    if hit is None or hit[0] is not w:
        if len(_NORM_SCALES) > 4096:  # weights of models long gone
            _NORM_SCALES.clear()
        hit = _NORM_SCALES[key] = (w, offset + w.float())
    return hit[1]


# ---------------------------------------------------------------------------- RoPE
def rope_inv_freq(params: dict, dim: int, max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling of one RoPE setup: `params` as
    config_forms.rope_setup normalises them (rope_type default, linear or yarn,
    rope_theta, partial_rotary_factor, factor, ...); `dim` the head dimension."""
    rot = int(dim * params.get("partial_rotary_factor", 1.0))
    base = params["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / params["factor"], 1.0
    if kind == "yarn":
        return _yarn(params, inv, rot, base, max_positions)
    raise ValueError(f"RoPE type {kind!r} is not supported (default, linear, yarn)")


def _yarn(params, inv, dim, base, max_positions):
    factor = params["factor"]
    original = params.get("original_max_position_embeddings") or max_positions
    mscale = params.get("mscale")
    mscale_all = params.get("mscale_all_dim")
    attention = params.get("attention_factor")

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention is None:
        attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all \
            else get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rot):
        return (dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype) -> tuple:
    """cos and sin [N, rot] at positions `pos` (the halves duplicated, as HF lays them),
    read from the table of (inv_freq, scaling): the same bits for a position whatever
    positions come with it (kernels.BlockTable)."""
    cos, sin = _rope_table(inv_freq, scaling, pos.device).rows(pos)
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)


_ROPE_TABLES: dict = {}


def _rope_table(inv_freq: torch.Tensor, scaling: float, device) -> "kernels.BlockTable":
    """cos(p f) * scaling and sin(p f) * scaling in float32 (HF's float32 product of the
    position and the inverse frequency), one table per RoPE setup and device."""
    key = (id(inv_freq), scaling, str(device))
    hit = _ROPE_TABLES.get(key)
    if hit is None or hit[0] is not inv_freq:
        if len(_ROPE_TABLES) > 256:  # tables of models long gone
            _ROPE_TABLES.clear()
        freq = inv_freq.float().to(device)

        def angles(pos):
            a = pos.float()[:, None] * freq[None, :]
            return a.cos() * scaling, a.sin() * scaling
        hit = _ROPE_TABLES[key] = (inv_freq, kernels.BlockTable(angles, device))
    return hit[1]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [N, heads, d]: the first `rot` dims rotated (rotate_half convention),
    the rest passed through (partial RoPE); cos [N, 1, rot] and the sin with its first
    half negated. HF's x * cos + rotate_half(x) * sin, where rotate_half(x) * sin =
    (-x2 * s, x1 * s) equals roll(x, half) * (-s, s) bit for bit, in three kernels
    rather than seven (one, kernels.rope, where the kernels take x's dtype)."""
    if _kernel(x) and x.dtype in (torch.float32, torch.bfloat16):
        return kernels.rope(x, cos, signed_sin)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + x.roll(rot // 2, -1) * signed_sin
    xr = x[..., :rot]
    return torch.cat((xr * cos + xr.roll(rot // 2, -1) * signed_sin, x[..., rot:]), dim=-1)


# ---------------------------------------------------------------------------- a batch
class Batch:
    """One forward's requests over the cache's pools."""

    def __init__(self, pools: dict, inputs: list[PagedInput], device) -> None:
        self.pools = pools
        self.inputs = inputs
        lens = [len(i.tokens) for i in inputs]
        if min(lens) <= 0:
            raise ValueError("every request in a batch brings at least one new token")
        self.lens = lens
        self.bounds = [0]
        for n in lens:
            self.bounds.append(self.bounds[-1] + n)
        self.device = device
        self.ids = torch.as_tensor([t for i in inputs for t in i.tokens], dtype=torch.long, device=device)
        self.pos = torch.cat([torch.arange(i.start, i.end, device=device) for i in inputs])
        self._plans: dict = {}
        self._rope: dict = {}
        self.commits: list = []
        #: the rows the rest of a layer computes for, once its mixer has written what the
        #: cache keeps of every row (KV, recurrent states): the forward sets it for its last
        #: layer to the rows that get logits (None: every row)
        self.keep: torch.Tensor | None = None

    def kept(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of t [N, ...] that the layer goes on with (`keep`)."""
        return t if self.keep is None else t.index_select(0, self.keep)

    def rotate(self, table: tuple, *xs: torch.Tensor) -> tuple:
        """Each x [N, heads, d] (queries, keys) rotated at this batch's positions by RoPE
        `table` (inverse frequencies, attention scaling: a model's per-layer table). The
        cos and sin are made once per table and dtype for every layer that shares it
        (Gemma 3's 18 layers have two tables)."""
        inv_freq, scaling = table
        dtype = xs[0].dtype
        key = (id(inv_freq), scaling, dtype)
        hit = self._rope.get(key)
        if hit is None or hit[0] is not inv_freq:
            cos, sin = rope_cos_sin(self.pos, inv_freq, scaling, dtype)
            half = cos.shape[-1] // 2
            signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            hit = self._rope[key] = (inv_freq, cos[:, None, :], signed[:, None, :])
        return tuple(rotate(x, hit[1], hit[2]) for x in xs)

    def plan(self, spec) -> "_Plan":
        """Where the keys of KV component `spec` live for this batch (from the first key
        each request's first new token reads: the tree's rule), grouped for attention."""
        plan = self._plans.get(spec.name)
        if plan is None:
            plan = self._plans[spec.name] = _Plan(self, spec)
        return plan

    def commit(self) -> None:
        """Write the recurrent states computed by every layer into their slots."""
        for mp, layer, slot, states in self.commits:
            for buf, value in zip(mp.layer_tensors(layer), states):
                buf[slot] = value
        self.commits = []


class _Plan:
    """One KV component's view of a batch: the flat pool slot (page * page_size + offset)
    of every new token, and where each query's keys are: for the row-invariant kernel,
    each request's key slots in position order and, per query row, the first of them it
    reads and how many; for torch's attention, the groups: every single-token request
    (decode) in one group, padded to its longest key span, each longer request in a group
    of its own. Made once per forward; it serves every layer."""

    __slots__ = ("write", "groups", "keys", "first", "count")

    def __init__(self, batch: Batch, spec) -> None:
        P = batch.pools[spec.name].page_size
        dev = batch.device
        spans, writes = [], []
        for r, inp in enumerate(batch.inputs):
            lo = max(0, spec.first_key(inp.start))
            slots = _slots(inp.pages[spec.name], P, lo, inp.end, dev)
            writes.append(slots[inp.start - lo:])
            spans.append((r, lo, slots))
        self.write = torch.cat(writes)
        self.groups = []
        self.keys = self.first = self.count = None
        if _kernel(self.write):
            # query at p reads keys max(lo, first_key(p)) .. p of its request's span
            self.keys = torch.cat([slots for _, _, slots in spans])
            firsts, counts, offset = [], [], 0
            for r, lo, slots in spans:
                pos = batch.pos[batch.bounds[r]:batch.bounds[r + 1]]
                first = torch.clamp(torch.as_tensor(spec.first_key(pos), device=dev), min=lo).expand_as(pos)
                firsts.append(first - lo + offset)
                counts.append(pos - first + 1)
                offset += len(slots)
            self.first, self.count = torch.cat(firsts), torch.cat(counts)
            return
        singles = [sp for sp in spans if batch.lens[sp[0]] == 1]
        if singles:
            S = max(len(slots) for _, _, slots in singles)
            rows = torch.as_tensor([[batch.bounds[r]] for r, _, _ in singles], dtype=torch.long, device=dev)
            keys = torch.zeros(len(singles), S, dtype=torch.long, device=dev)
            k_pos = torch.full((len(singles), S), -1, dtype=torch.long, device=dev)
            for j, (r, lo, slots) in enumerate(singles):
                keys[j, :len(slots)] = slots
                k_pos[j, :len(slots)] = torch.arange(lo, lo + len(slots), device=dev)
            q_pos = batch.pos[rows]                                          # [B, 1]
            self.groups.append(_Group(rows, keys, _allowed(spec, q_pos, k_pos), len(singles) == len(spans)))
        for r, lo, slots in spans:
            if batch.lens[r] == 1:
                continue
            a, b = batch.bounds[r], batch.bounds[r + 1]
            rows = torch.arange(a, b, device=dev)[None]
            k_pos = torch.arange(lo, lo + len(slots), device=dev)[None]
            causal = lo == batch.inputs[r].start and (spec.window is None or b - a <= spec.window)
            self.groups.append(_Group(rows, slots[None], _allowed(spec, batch.pos[rows], k_pos), len(spans) == 1,
                                      causal))


class _Group:
    """Queries at batch rows [B, T] over the keys in flat pool slots [B, S], where
    `allowed` [B, T, S]; the additive mask SDPA takes, made once, with or without one
    more key column for attention sinks."""

    __slots__ = ("rows", "slots", "allowed", "every_row", "causal", "_bias", "_sink")

    def __init__(self, rows, slots, allowed, every_row: bool = False, causal: bool = False) -> None:
        self.rows, self.slots, self.allowed = rows, slots, allowed
        self.every_row = every_row  # rows are the batch's rows 0..N-1, in order: no gather, no scatter
        # query t reads exactly keys 0..t (SDPA's is_causal: it skips the blocks above the
        # diagonal, and gives what the -inf mask gives, bit for bit)
        self.causal = causal
        self._bias = self._sink = None

    def bias(self) -> torch.Tensor:
        """[B, 1, T, S]: 0 where allowed, -inf elsewhere."""
        if self._bias is None:
            self._bias = torch.zeros(self.allowed.shape, dtype=torch.float32, device=self.allowed.device) \
                .masked_fill_(~self.allowed, float("-inf"))[:, None]
        return self._bias

    def with_sink(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [B, S+1] and bias [B, 1, T, S+1] with a last key column (any slot: its key
        and value are zeroed after the gather) that every query may read."""
        if self._sink is None:
            bias = self.bias()
            self._sink = (torch.cat((self.slots, self.slots[:, :1]), dim=1),
                          torch.cat((bias, bias.new_zeros(*bias.shape[:-1], 1)), dim=-1))
        return self._sink


def _slots(pages, P: int, lo: int, end: int, device) -> torch.Tensor:
    """Flat pool slots of positions [lo, end) of a request whose pages are `pages`."""
    first, last = lo // P, -(-end // P)
    window = list(pages[first:last])
    if len(window) < last - first or min(window, default=0) < 0:
        raise ValueError(f"a page needed for positions [{lo}, {end}) is absent")
    idx = torch.as_tensor(window, dtype=torch.long, device=device)
    if P == 1:
        return idx
    flat = (idx[:, None] * P + torch.arange(P, device=device)).flatten()
    return flat[lo - first * P:end - first * P]


def _allowed(spec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[B, T, S]: key k_pos [B, S] is visible to the query at q_pos [B, T] (causal, within
    the spec's window; padding has k_pos -1)."""
    allowed = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)
    if spec.window is not None:
        allowed &= k_pos[:, None, :] >= spec.first_key(q_pos)[:, :, None]
    return allowed


# ---------------------------------------------------------------------------- attention
def paged_attention(batch: Batch, spec, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write k, v [N, KV, d] of the new tokens into component `spec`'s pages of `layer`,
    then attend: q [N, H, d] over each request's keys (causal; a sliding window reads
    from spec.first_key). `sinks` [H]: per-head logits that join each softmax (gpt-oss).
    Returns [N, H, d], or for the rows of batch.keep only where the forward set it (the
    keys and values of every row written all the same)."""
    pool = batch.pools[spec.name]
    kp, vp = pool.slots(layer)                                          # [slots, KV, d] views
    plan = batch.plan(spec)
    kp.index_copy_(0, plan.write, k.to(kp.dtype))
    vp.index_copy_(0, plan.write, v.to(vp.dtype))
    if plan.keys is not None:  # the row-invariant kernel, over the pools where they are
        first, count, keep = plan.first, plan.count, batch.keep
        if keep is not None:   # the queries the layer goes on with, alone: each row's bits the same
            if not len(keep):
                return q.new_empty((0, *q.shape[1:]))
            q, first, count = q.index_select(0, keep), first.index_select(0, keep), count.index_select(0, keep)
        return kernels.attention(q, kp, vp, plan.keys, first, count, scale, sinks)
    return batch.kept(_torch_attention(q, kp, vp, plan, scale, sinks))


def _torch_attention(q, kp, vp, plan, scale, sinks) -> torch.Tensor:
    """paged_attention's queries over the pools by torch's attention, group by group."""
    out = None
    for g in plan.groups:
        qg = (q.view(*g.rows.shape, *q.shape[1:]) if g.every_row else q[g.rows]).float().transpose(1, 2)  # [B, H, T, d]
        if sinks is None:
            k_, v_ = (_gather(t, g.slots).float().transpose(1, 2) for t in (kp, vp))  # [B, KV, S, d]
            o = F.scaled_dot_product_attention(qg, k_, v_, attn_mask=None if g.causal else g.bias(), scale=scale,
                                               is_causal=g.causal, enable_gqa=k_.shape[1] != qg.shape[1])
        else:  # a sink is one more key, of value 0, whose score is the sink's logit
            slots, bias = g.with_sink()
            k_, v_ = (_gather(t, slots).float() for t in (kp, vp))
            k_[:, -1], v_[:, -1] = 0.0, 0.0
            mask = bias.expand(-1, qg.shape[1], -1, -1).clone()
            mask[..., -1] = sinks.float()[None, :, None]
            o = F.scaled_dot_product_attention(qg, k_.transpose(1, 2), v_.transpose(1, 2), attn_mask=mask,
                                               scale=scale, enable_gqa=k_.shape[2] != qg.shape[1])
        o = o.transpose(1, 2).to(q.dtype)                                       # [B, T, H, d]
        if g.every_row:
            return o.reshape(q.shape)
        if out is None:
            out = torch.empty_like(q)
        out[g.rows] = o
    return out


def _gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows `slots` [B, S] of a flat pool [slots, KV, d]: [B, S, KV, d] (index_select:
    several times faster than advanced indexing on the CPU)."""
    return torch.index_select(pool, 0, slots.flatten()).view(*slots.shape, *pool.shape[1:])


# ---------------------------------------------------------------------------- recurrent
def run_recurrent(batch: Batch, spec, layer: int, h: torch.Tensor, mixer) -> torch.Tensor:
    """Each request's recurrent mixer over its new tokens, from the state in its slot:
    `mixer(x [B, T, D], states) -> (out [B, T, ...], states)` where states are the
    layer's tensors (the pool's conv and recurrent state) for B slots. Single-token
    requests (decode) run together, B of them; a longer one runs alone, in pieces cut at
    its capture positions, where its state is copied out. Every write waits for
    Batch.commit (after the last layer). Returns [N, ...] in batch order (the rows of
    batch.keep where the forward set it: every row's state advances all the same)."""
    mp = batch.pools[spec.name]
    bufs = mp.layer_tensors(layer)
    pieces = []                                          # (rows of the batch, out [rows, ...])
    singles = [r for r in range(len(batch.inputs)) if batch.lens[r] == 1]
    if len(singles) < 2:
        singles = []
    if singles:
        inputs = [batch.inputs[r] for r in singles]
        slots = torch.as_tensor([inp.state_slot for inp in inputs], dtype=torch.long, device=h.device)
        rows = torch.as_tensor([batch.bounds[r] for r in singles], dtype=torch.long, device=h.device)
        o, states = mixer(h[rows][:, None], tuple(t[slots] for t in bufs))
        pieces.append((rows, o[:, 0]))
        for j, inp in enumerate(inputs):
            mine = tuple(t[j] for t in states)
            slot = inp.capture.get(inp.start + 1)
            if slot is not None:
                batch.commits.append((mp, layer, slot, mine))
            batch.commits.append((mp, layer, inp.state_slot, mine))
    alone = set(singles)
    for r, inp in enumerate(batch.inputs):
        if r in alone:
            continue
        a, b = batch.bounds[r], batch.bounds[r + 1]
        states = tuple(t[inp.state_slot][None] for t in bufs)
        s, T = inp.start, b - a
        cuts = sorted(p - s for p in inp.capture if s < p <= s + T)
        x, lo = h[a:b][None], 0
        for hi in cuts + [T]:
            if hi > lo:
                o, states = mixer(x[:, lo:hi], states)
                pieces.append((slice(a + lo, a + hi), o[0]))
            slot = inp.capture.get(s + hi)
            if slot is not None:
                batch.commits.append((mp, layer, slot, tuple(t[0] for t in states)))
            lo = hi
        batch.commits.append((mp, layer, inp.state_slot, tuple(t[0] for t in states)))
    first = pieces[0][1]
    out = first.new_empty((h.shape[0], *first.shape[1:]))
    for rows, o in pieces:
        out[rows] = o
    return batch.kept(out)


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias=None, act=None):
    """A depthwise causal conv over x [B, T, C], starting from the last K-1 inputs
    conv_state [B, C, K-1], kernel weight [C, K]. Returns (y [B, T, C], the new conv
    state)."""
    K = weight.shape[-1]
    seq = torch.cat((conv_state.transpose(-1, -2).to(x.dtype), x), dim=-2)  # [B, K-1+T, C]
    T = x.shape[-2]
    y = sum(seq[:, j:j + T] * weight[:, j] for j in range(K))
    if bias is not None:
        y = y + bias
    if act == "silu":
        y = silu(y)
    return y, seq[:, -(K - 1):].transpose(-1, -2).contiguous() if K > 1 else conv_state
