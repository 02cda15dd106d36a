"""Qwen3-Next and Qwen3.5 (text; dense and MoE): gated delta-net (GDN) linear-attention
layers with gated full-attention layers (by default every fourth).

Full-attention layers: q_proj gives per head [q | gate] (the output is scaled by
sigmoid(gate) before o_proj), QK-norm, partial RoPE (partial_rotary_factor, default
0.25), scale head_dim^-1/2. GDN layers: a depthwise causal conv (kernel K, SiLU) over
[q | k | v], L2-normalised q and k (q also scaled by dk^-1/2), a per-head decay
g = -exp(A_log) * softplus(a + dt_bias) and write strength beta = sigmoid(b), the gated
delta rule on a float32 state [Hv, dk, dv] (each key head serves Hv/Hk value heads), and
an RMSNorm (plain w) of the output times silu(z). Every main RMSNorm scales by (1 + w).

Qwen3-Next projects [q|k|v|z] and [b|a] with one fused matrix each, grouped by key head;
Qwen3.5 has separate in_proj_qkv / z / b / a. Qwen3-Next and Qwen3.5-MoE use sparse MoE
blocks (softmax over all experts, top-k, renormalised where norm_topk_prob says so (always
for Qwen3.5-MoE), plus a shared expert gated by a sigmoid); Qwen3.5 dense has a SwiGLU
MLP. The multimodal Qwen3.5 wrapper keeps the text model's weights under
model.language_model.* (read as model.*: checkpoint.py).

Config forms: the released Qwen3-Next gives `full_attention_interval` (every Nth layer
full, 4 by default) and the legacy `rope_theta` / `partial_rotary_factor` (0.25 by
default); Qwen3.5 gives `layer_types` and `rope_parameters` (with its multimodal RoPE's
`mrope_section`, the same rotation for text).

The recurrence runs token by token, so any split of a sequence (chunked prefill, a
capture at any position, a resume from a checkpoint) reaches the same state; the conv
state keeps the last K-1 conv inputs (transformers keeps K, of which K-1 matter)."""
from __future__ import annotations

import torch

from ...specs import RecurrentShape
from .config_forms import FULL, LINEAR, ConfigError, every_nth
from .family import RECURRENT, HFModel
from .. import kernels
from .ops import causal_conv, exp, gated, linear, paged_attention, rms_norm, run_recurrent, sigmoid, silu, softplus

_COMMON = {"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "head_dim": 256,
           "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "tie_word_embeddings": False}
#: the config classes' defaults (transformers 5.24) for the keys read here
NEXT_DEFAULTS = {**_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                 "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                 "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True}
QWEN3_5_DEFAULTS = {**_COMMON, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                    "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4}
QWEN3_5_MOE_DEFAULTS = {**_COMMON, "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "num_experts_per_tok": 8,
                        "num_experts": 256}


class Qwen3Next(HFModel):
    model_types = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
    defaults = {"qwen3_next": NEXT_DEFAULTS, "qwen3_5_text": QWEN3_5_DEFAULTS, "qwen3_5": QWEN3_5_DEFAULTS,
                "qwen3_5_moe_text": QWEN3_5_MOE_DEFAULTS, "qwen3_5_moe": QWEN3_5_MOE_DEFAULTS}
    layer_kinds = (LINEAR, FULL)
    pattern_keys = ("full_attention_interval",)
    partial_rotary_default = 0.25  # the classes' default where the config names none
    q_rows_per_head = 2  # q_proj gives each head [q | gate]

    @classmethod
    def derive_kinds(cls, c):
        return every_nth(c, "full_attention_interval", 4, FULL, LINEAR)

    @classmethod
    def check_config(cls, c):
        super().check_config(c)
        if c.get("hidden_act") != "silu":
            raise ConfigError("hidden_act", f"{c.get('hidden_act')!r} is not supported (silu)")
        if c["linear_num_value_heads"] % c["linear_num_key_heads"]:
            raise ConfigError("linear_num_value_heads", f"{c['linear_num_value_heads']} is not a multiple of "
                                                        f"linear_num_key_heads ({c['linear_num_key_heads']})")

    def __init__(self, ckpt, dtype=torch.float32) -> None:
        super().__init__(ckpt, dtype)
        c = self.config
        self.eps = c["rms_norm_eps"]
        # gated delta-net
        self.k_heads, self.v_heads = c["linear_num_key_heads"], c["linear_num_value_heads"]
        self.dk, self.dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        self.conv_kernel = c["linear_conv_kernel_dim"]
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.top_k = c.get("num_experts_per_tok")
        # Qwen3.5-MoE's router always renormalises its top-k (its class has no norm_topk_prob)
        self.norm_topk = c.get("norm_topk_prob", True) if self.name == "qwen3_next" else True
        self._fuse_experts()

    def _fuse_experts(self) -> None:
        """Per-expert projections (experts.{e}.gate_proj/up_proj/down_proj, older files) as
        transformers' fused in-memory layout: gate_up [E, 2I, D], down [E, D, I]."""
        for name in [n for n in self.weights if n.endswith(".mlp.experts.0.gate_proj.weight")]:
            p = name.removesuffix("0.gate_proj.weight")
            E = 0
            while self.has(f"{p}{E}.gate_proj.weight"):
                E += 1
            part = lambda e, proj: self.weights.pop(f"{p}{e}.{proj}.weight")  # noqa: E731
            self.weights[p + "gate_up_proj"] = torch.stack(
                [torch.cat((part(e, "gate_proj"), part(e, "up_proj"))) for e in range(E)])
            self.weights[p + "down_proj"] = torch.stack([part(e, "down_proj") for e in range(E)])

    def expected_shapes(self):
        """Beside the attention layers', each GDN layer's projections, conv, decay and norm."""
        out = super().expected_shapes()
        c = self.config
        D, Hk, Hv = c["hidden_size"], c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv, K = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
        conv = 2 * Hk * dk + Hv * dv
        heads = "linear_num_key_heads x linear_key_head_dim x 2 + linear_num_value_heads x linear_value_head_dim"
        for i, kind in enumerate(self.kinds):
            if kind != LINEAR:
                continue
            p = f"model.layers.{i}.linear_attn."
            if self.has(p + "in_proj_qkvz.weight"):
                out[p + "in_proj_qkvz.weight"] = ((conv + Hv * dv, D), f"{heads} + the z heads, hidden_size")
                out[p + "in_proj_ba.weight"] = ((2 * Hv, D), "linear_num_value_heads x 2, hidden_size")
            else:
                out[p + "in_proj_qkv.weight"] = ((conv, D), f"{heads}, hidden_size")
                out[p + "in_proj_z.weight"] = ((Hv * dv, D), "linear_num_value_heads x linear_value_head_dim, "
                                                             "hidden_size")
                out[p + "in_proj_b.weight"] = out[p + "in_proj_a.weight"] = ((Hv, D), "linear_num_value_heads, "
                                                                                    "hidden_size")
            out[p + "conv1d.weight"] = ((conv, 1, K), f"{heads}, linear_conv_kernel_dim")
            out[p + "A_log"] = out[p + "dt_bias"] = ((Hv,), "linear_num_value_heads")
            out[p + "norm.weight"] = ((dv,), "linear_value_head_dim")
            out[p + "out_proj.weight"] = ((D, Hv * dv), "hidden_size, linear_num_value_heads x linear_value_head_dim")
        return out

    # ------------------------------------------------------------------ layer list
    def recurrent_shape(self, i: int) -> RecurrentShape:
        return RecurrentShape(conv_shape=(self.conv_dim, self.conv_kernel - 1),
                              state_shape=(self.v_heads, self.dk, self.dv),
                              conv_dtype=str(self.dtype).removeprefix("torch."), state_dtype="float32")

    # ------------------------------------------------------------------ forward
    def embed(self, ids):
        return self.w("model.embed_tokens.weight")[ids]

    def final_norm(self, x):
        return rms_norm(x, self.w("model.norm.weight"), self.eps, 1.0, dtype=self.dtype)

    def block(self, i, x, batch):
        p = f"model.layers.{i}."
        h = rms_norm(x, self.w(p + "input_layernorm.weight"), self.eps, 1.0, dtype=self.dtype)
        if self.kinds[i] == LINEAR:
            h = self._gdn(i, p + "linear_attn.", h, batch)
        else:
            h = self._attention(i, p + "self_attn.", h, batch)
        x = batch.kept(x) + h
        h = rms_norm(x, self.w(p + "post_attention_layernorm.weight"), self.eps, 1.0, dtype=self.dtype)
        if self.has(p + "mlp.gate.weight"):
            return x + self._moe(p + "mlp.", h)
        return x + self._mlp(p + "mlp.", h)

    def _linear(self, name: str, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.w(name + ".weight"), self.weights.get(name + ".bias"))

    # ------------------------------------------------------------------ gated attention
    def _attention(self, i, p, h, batch):
        N, d = h.shape[0], self.head_dim
        qg, k, v = self.projections(h, p + "q_proj", p + "k_proj", p + "v_proj")
        qg = qg.view(N, self.heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(N, self.heads * d)
        k, v = k.view(N, self.kv_heads, d), v.view(N, self.kv_heads, d)
        q = rms_norm(q, self.w(p + "q_norm.weight"), self.eps, 1.0)
        k = rms_norm(k, self.w(p + "k_norm.weight"), self.eps, 1.0)
        q, k = batch.rotate(self.rope[i], q, k)
        a = paged_attention(batch, self.spec(i), i, q, k, v, scale=d ** -0.5)
        return self._linear(p + "o_proj", a.flatten(1) * sigmoid(batch.kept(gate)))

    # ------------------------------------------------------------------ gated delta-net
    def _projections(self, p, h):
        """[q|k|v] (the conv's input, [N, conv_dim]), z [N, Hv, dv], b and a [N, Hv]."""
        N, Hk, Hv = h.shape[0], self.k_heads, self.v_heads
        if self.has(p + "in_proj_qkvz.weight"):  # Qwen3-Next: fused, grouped by key head
            r = Hv // Hk
            qkvz = self._linear(p + "in_proj_qkvz", h).view(N, Hk, 2 * self.dk + 2 * r * self.dv)
            q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
            b, a = self._linear(p + "in_proj_ba", h).view(N, Hk, 2 * r).split([r, r], dim=-1)
            qkv = torch.cat((q.reshape(N, -1), k.reshape(N, -1), v.reshape(N, -1)), dim=-1)
            return qkv, z.reshape(N, Hv, self.dv), b.reshape(N, Hv), a.reshape(N, Hv)
        qkv, z, b, a = self.projections(h, p + "in_proj_qkv", p + "in_proj_z", p + "in_proj_b", p + "in_proj_a")
        return qkv, z.view(N, Hv, self.dv), b, a

    def _gdn(self, i, p, h, batch):
        N = h.shape[0]
        qkv, z, b, a = self._projections(p, h)
        beta = sigmoid(b)
        g = -exp(self.w(p + "A_log").float()) * softplus(a.float() + self.w(p + "dt_bias"))
        # the mixer reads one tensor per token: [q|k|v] (exact in float32 whatever the model's
        # dtype), beta and g
        packed = torch.cat((qkv.float(), beta.float(), g), dim=-1)
        conv_w = self.w(p + "conv1d.weight").reshape(self.conv_dim, self.conv_kernel)
        conv_b = self.weights.get(p + "conv1d.bias")
        dtype = h.dtype

        def mixer(x, states):
            conv_state, state = states
            # the conv accumulates in float32 and rounds once to the model's dtype, then SiLU
            # (as a depthwise F.conv1d does); its inputs are the model's dtype's values
            y, window = causal_conv(x[..., :self.conv_dim], conv_state, conv_w.float(),
                                    None if conv_b is None else conv_b.float())
            y, conv_state = silu(y.to(dtype)), window.to(conv_state.dtype)
            Hv = self.v_heads
            beta_t, g_t = x[..., self.conv_dim:self.conv_dim + Hv], x[..., self.conv_dim + Hv:]
            out, state = self._delta_rule(y, beta_t, g_t, state)
            return out.to(dtype), (conv_state, state)

        core = run_recurrent(batch, RECURRENT, i, packed, mixer).view(-1, self.v_heads, self.dv)
        out = _gated_rms_norm(core, batch.kept(z), self.w(p + "norm.weight"), self.eps)
        return self._linear(p + "out_proj", out.flatten(1))

    def _delta_rule(self, y, beta, g, state):
        """The gated delta rule in float32 from `state` [B, Hv, dk, dv]: y [B, T, conv_dim]
        the conv's output, beta and g [B, T, Hv]. Returns (out [B, T, Hv, dv], the new
        state). Token by token, or in chunks for one request's longer piece."""
        B, T, Hk, Hv = *y.shape[:2], self.k_heads, self.v_heads
        q, k, v = y.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = _l2norm(q.view(B, T, Hk, self.dk)) * self.dk ** -0.5
        k = _l2norm(k.view(B, T, Hk, self.dk))
        if Hv != Hk:  # each key head serves Hv / Hk consecutive value heads
            q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
        v = v.view(B, T, Hv, self.dv)
        if y.device.type == "cpu" and kernels.available():  # row-invariant, token by token, in C
            return kernels.delta_rule(q, k, v, beta, g, state)
        beta, g, S = beta.float(), g.float(), state.float()
        if T >= CHUNK_FROM and B == 1:
            out, S = _chunked_delta_rule(q[0], k[0], v[0], beta[0], g[0], S[0])
            return out[None], S[None]
        decay = g.exp()
        out = torch.empty(B, T, Hv, self.dv, dtype=torch.float32, device=y.device)
        for t in range(T):
            S = S * decay[:, t, :, None, None]
            kt = k[:, t, :, :, None]
            recalled = (S * kt).sum(-2)                                  # [B, Hv, dv]: k^T S
            delta = (v[:, t] - recalled) * beta[:, t, :, None]
            S = S + kt * delta[:, :, None, :]
            out[:, t] = (S * q[:, t, :, :, None]).sum(-2)
        return out, S

    # ------------------------------------------------------------------ MLP and MoE
    def _mlp(self, p, h):
        g, u = self.projections(h, p + "gate_proj", p + "up_proj")
        return self._linear(p + "down_proj", gated("silu", g, u))

    def _moe(self, p, h):
        logits = linear(h, self.w(p + "gate.weight"))
        probs = logits.softmax(-1, dtype=torch.float32)
        top, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        top = top.to(logits.dtype)
        gate_up, down = self.w(p + "experts.gate_up_proj"), self.w(p + "experts.down_proj")
        # expert by expert, ascending, as transformers adds them: a token's sum is in the
        # same order whatever tokens come with it
        out = torch.zeros_like(h)
        for e in idx.unique().tolist():
            tok, slot = torch.where(idx == e)
            gate, up = linear(h[tok], gate_up[e]).chunk(2, dim=-1)
            ye = linear(gated("silu", gate, up), down[e])
            out.index_add_(0, tok, (ye * top[tok, slot, None]).to(out.dtype))
        if self.has(p + "shared_expert.gate_proj.weight"):
            shared = self._mlp(p + "shared_expert.", h)
            if self.has(p + "shared_expert_gate.weight"):
                shared = sigmoid(linear(h, self.w(p + "shared_expert_gate.weight"))) * shared
            out = out + shared
        return out


#: from this many tokens a piece runs the chunked form (decode steps stay token by token)
CHUNK_FROM = 8
CHUNK = 64


def _chunked_delta_rule(q, k, v, beta, g, S):
    """The same recurrence as the token loop, CHUNK tokens at a time. Within a chunk,
    with G_i the cumulative log decay and u_i the value token i writes,
    u_i = beta_i (v_i - e^G_i k_i.S0 - sum_{j<i} e^(G_i-G_j) (k_i.k_j) u_j): one unit
    lower-triangular solve; then o_i = e^G_i q_i.S0 + sum_{j<=i} e^(G_i-G_j) (q_i.k_j) u_j
    and the state leaves as e^G_C S0 + sum_j e^(G_C-G_j) k_j u_j^T. q, k [T, H, dk],
    v [T, H, dv], beta, g [T, H] (g the log decay), S [H, dk, dv]; all float32."""
    T = q.shape[0]
    outs = []
    for c0 in range(0, T, CHUNK):
        qc, kc, vc = (x[c0:c0 + CHUNK].transpose(0, 1) for x in (q, k, v))    # [H, C, d]
        bc, G = beta[c0:c0 + CHUNK].t(), g[c0:c0 + CHUNK].t().cumsum(-1)     # [H, C]
        C = G.shape[1]
        below = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        ratio = (G[:, :, None] - G[:, None, :]).masked_fill(~below, float("-inf")).exp()  # e^(G_i-G_j), j<=i
        eG = G.exp()[..., None]
        A = bc[..., None] * ratio * (kc @ kc.transpose(-1, -2))
        rhs = bc[..., None] * (vc - eG * (kc @ S))
        U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        outs.append((eG * (qc @ S) + (ratio * (qc @ kc.transpose(-1, -2))) @ U).transpose(0, 1))
        last = G[:, -1:]
        S = last.exp()[..., None] * S + (kc * (last - G).exp()[..., None]).transpose(-1, -2) @ U
    return torch.cat(outs), S


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (normalised in float32, cast back, scaled by plain w),
    times silu(z) in float32, cast back to x's dtype."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    y = w * y.to(x.dtype)
    return (y * silu(z.float())).to(x.dtype)
