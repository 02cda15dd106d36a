"""Nemotron-H (nemotron_h): one mixer per layer behind one RMSNorm and a residual,
Mamba2 (granite_hybrid.Mamba2), attention with no RoPE, a squared-ReLU MLP or a MoE of
squared-ReLU experts (sigmoid router with a score-correction bias, grouped top-k, a
shared expert, optional latent projections). MLP and MoE layers keep no cache.

Checkpoints name the model `backbone.` (NVIDIA's layout, which transformers writes back)
or `model.`; experts one by one (`experts.N.up_proj.weight`) or stacked
(`experts.up_proj`)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .checkpoint import FULL, LINEAR, MAMBA, MLP, MOE
from .family import RECURRENT, HFModel
from .granite_hybrid import Mamba2, config_float, linear
from .ops import paged_attention, rms_norm


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class NemotronH(HFModel):
    model_types = ("nemotron_h",)

    def __init__(self, ckpt, dtype=torch.float32) -> None:
        super().__init__(ckpt, dtype)
        c = self.config
        self.root = "backbone." if self.has("backbone.embeddings.weight") else "model."
        self.eps = c.get("layer_norm_epsilon", c.get("rms_norm_eps", 1e-5))
        self.scale = self.head_dim ** -0.5
        act = c.get("mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"{ckpt.path}: mlp_hidden_act {act!r} is not supported (relu2)")

        def first(*keys, default=None):
            return next((c[k] for k in keys if c.get(k) is not None), default)

        heads, head_dim = c.get("mamba_num_heads", 128), c.get("mamba_head_dim", 64)
        # transformers' mixer clamps dt to [time_step_min, inf), whatever time_step_limit says
        lo = config_float(first("time_step_min", "mamba_dt_min"), 0.001)
        mamba = dict(heads=heads, head_dim=head_dim, d_state=c.get("ssm_state_size", 128),
                     groups=first("n_groups", "mamba_n_groups", default=8),
                     conv_kernel=first("conv_kernel", "mamba_d_conv", default=4), eps=self.eps,
                     dt_limit=(lo, math.inf), act=c.get("mamba_hidden_act", "silu"))
        self.mixers = {i: Mamba2(self, f"{self.root}layers.{i}.mixer.", **mamba)
                       for i, k in enumerate(self.kinds) if k in (LINEAR, MAMBA)}
        for i, k in enumerate(self.kinds):
            if k not in (FULL, LINEAR, MAMBA, MLP, MOE):
                raise ValueError(f"{ckpt.path}: layer {i} is {k!r}; nemotron_h has Mamba2, attention, mlp and "
                                 f"moe layers")
        # MoE routing
        self.top_k = c.get("num_experts_per_tok", 2)
        self.n_experts = first("n_routed_experts", "num_local_experts", default=0)
        self.n_group, self.topk_group = c.get("n_group", 1) or 1, c.get("topk_group", 1) or 1
        self.norm_topk = c.get("norm_topk_prob", True)
        self.routed_scale = config_float(c.get("routed_scaling_factor"), 1.0)

    def recurrent_shape(self, i):
        return self.mixers[i].shape(self.dtype)

    def embed(self, ids):
        return self.w(self.root + "embeddings.weight")[ids]

    def block(self, i, x, batch):
        p = f"{self.root}layers.{i}."
        h = rms_norm(x, self.w(p + "norm.weight"), self.eps)
        kind = self.kinds[i]
        if i in self.mixers:
            h = self.mixers[i](batch, RECURRENT, i, h)
        elif kind == FULL:
            h = self.attention(p + "mixer.", i, h, batch)
        elif kind == MLP:
            h = self.mlp(p + "mixer.", h)
        else:
            h = self.moe(p + "mixer.", h)
        return x + h

    def attention(self, p, i, h, batch):
        N = h.shape[0]
        b = self.weights.get
        q = linear(h, self.w(p + "q_proj.weight"), b(p + "q_proj.bias")).view(N, self.heads, self.head_dim)
        k = linear(h, self.w(p + "k_proj.weight"), b(p + "k_proj.bias")).view(N, self.kv_heads, self.head_dim)
        v = linear(h, self.w(p + "v_proj.weight"), b(p + "v_proj.bias")).view(N, self.kv_heads, self.head_dim)
        a = paged_attention(batch, self.spec(i), i, q, k, v, scale=self.scale)
        return linear(a.reshape(N, -1), self.w(p + "o_proj.weight"), b(p + "o_proj.bias"))

    def mlp(self, p, h):
        b = self.weights.get
        return linear(relu2(linear(h, self.w(p + "up_proj.weight"), b(p + "up_proj.bias"))),
                      self.w(p + "down_proj.weight"), b(p + "down_proj.bias"))

    def route(self, p, h):
        """Sigmoid scores; the top-k chosen (with the correction bias) among the best
        topk_group groups; their scores (without it), normalised, scaled."""
        logits = linear(h.float(), self.w(p + "gate.weight").float())
        scores = logits.sigmoid()
        bias = self.weights.get(p + "gate.e_score_correction_bias")
        choice = scores + bias.float() if bias is not None else scores
        E, G = self.n_experts, self.n_group
        if G > 1:
            group = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(group).scatter_(1, group.topk(self.topk_group, dim=-1, sorted=False)[1], 1)
            mask = keep[:, :, None].expand(-1, G, E // G).reshape(-1, E).bool()
            choice = choice.masked_fill(~mask, float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * self.routed_scale

    def expert(self, p, e, name):
        t = self.weights.get(f"{p}experts.{e}.{name}.weight")
        return t if t is not None else self.w(f"{p}experts.{name}")[e]

    def moe(self, p, h):
        idx, weights = self.route(p, h)
        b = self.weights.get
        x = h
        if self.has(p + "fc1_latent_proj.weight"):
            x = linear(h, self.w(p + "fc1_latent_proj.weight"), b(p + "fc1_latent_proj.bias"))
        out = torch.zeros(x.shape, dtype=weights.dtype, device=x.device)
        for e in idx.unique().tolist():
            rows, slot = torch.where(idx == e)
            y = linear(relu2(linear(x[rows], self.expert(p, e, "up_proj"))), self.expert(p, e, "down_proj"))
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        out = out.to(h.dtype)
        if self.has(p + "fc2_latent_proj.weight"):
            out = linear(out, self.w(p + "fc2_latent_proj.weight"), b(p + "fc2_latent_proj.bias"))
        return out + self.mlp(p + "shared_experts.", h)

    def head(self, x):
        lm_head = self.tied_head(self.root + "embeddings.weight")
        return linear(rms_norm(x, self.w(self.root + "norm_f.weight"), self.eps), lm_head)


__all__ = ["NemotronH"]
