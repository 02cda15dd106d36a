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

from .config_forms import FULL, LINEAR, MLP, MOE, ConfigError, listed_kinds, pattern_kinds
from .family import RECURRENT, HFModel
from .granite_hybrid import Mamba2, config_float
from .gemm import is_packed
from .ops import linear, paged_attention, rms_norm, sigmoid


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


#: NemotronHConfig's defaults (transformers 5.24) for the keys read here
DEFAULTS = {
    "vocab_size": 131072, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 4096, "intermediate_size": 21504, "mlp_hidden_act": "relu2", "ssm_state_size": 128,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4,
    "expand": 2, "time_step_min": 0.001, "chunk_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
}
#: the legacy (and attribute_map) names NemotronHConfig still reads
ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
           "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max", "mamba_dt_limit": "time_step_limit",
           "mamba_chunk_size": "chunk_size", "mamba_conv_bias": "use_conv_bias",
           "num_local_experts": "n_routed_experts"}
#: hybrid_override_pattern's characters
PATTERN = {"M": LINEAR, "*": FULL, "-": MLP, "E": MOE}


class NemotronH(HFModel):
    """Config forms: `layers_block_type` (or `layer_types`) in today's names, or the
    released checkpoints' `hybrid_override_pattern` (M Mamba2, * attention, - MLP, E MoE)
    with mamba_* names for the mixer's settings; the layer count is the list's length
    (num_hidden_layers is not read, as in NemotronHConfig)."""

    model_types = ("nemotron_h",)
    defaults = {"nemotron_h": DEFAULTS}
    aliases = ALIASES
    layer_kinds = (LINEAR, FULL, MLP, MOE)
    kind_keys = ("layer_types", "layers_block_type")
    pattern_keys = ("hybrid_override_pattern",)

    @classmethod
    def read_kinds(cls, c):
        listed = listed_kinds(c, cls.kind_keys)  # the list's length is the layer count
        if listed is not None:
            return listed
        cls.check_foreign_markers(c)
        return cls.derive_kinds(c), cls.pattern_keys[0]

    @classmethod
    def derive_kinds(cls, c):
        if c.get("hybrid_override_pattern") is not None:
            return pattern_kinds(c, "hybrid_override_pattern", PATTERN)
        return [LINEAR, MOE, FULL, MLP]  # NemotronHConfig's layers when the config names none

    @classmethod
    def read_rope(cls, c):
        return {}  # no RoPE: attention finds positions through the Mamba2 layers

    @classmethod
    def check_config(cls, c):
        super().check_config(c)
        if c["mlp_hidden_act"] != "relu2":
            raise ConfigError("mlp_hidden_act", f"{c['mlp_hidden_act']!r} is not supported (relu2)")

    @property
    def root(self) -> str:
        """The model's module path: NVIDIA's `backbone.` or `model.`."""
        return "backbone." if self.has("backbone.embeddings.weight") else "model."

    @property
    def embed_weight(self) -> str:
        return self.root + "embeddings.weight"

    def attention_prefix(self, i):
        return f"{self.root}layers.{i}.mixer."

    def __init__(self, ckpt, dtype=torch.float32) -> None:
        super().__init__(ckpt, dtype)
        c = self.config
        self.eps = c["layer_norm_epsilon"]
        self.scale = self.head_dim ** -0.5
        # transformers' mixer clamps dt to [time_step_min, inf), whatever time_step_limit says
        mamba = dict(heads=c["mamba_num_heads"], head_dim=c["mamba_head_dim"], d_state=c["ssm_state_size"],
                     groups=c["n_groups"], conv_kernel=c["conv_kernel"], eps=self.eps,
                     dt_limit=(config_float(c["time_step_min"], 0.001), math.inf), act=c["mamba_hidden_act"])
        self.mixers = {i: Mamba2(self, f"{self.root}layers.{i}.mixer.", **mamba)
                       for i, k in enumerate(self.kinds) if k == LINEAR}
        # MoE routing
        self.top_k = c["num_experts_per_tok"]
        self.n_experts = c["n_routed_experts"]
        self.n_group, self.topk_group = c["n_group"] or 1, c["topk_group"] or 1
        self.norm_topk = c["norm_topk_prob"]
        self.routed_scale = config_float(c["routed_scaling_factor"], 1.0)

    def recurrent_shape(self, i):
        return self.mixers[i].shape(self.dtype)

    def embed(self, ids):
        return self.w(self.root + "embeddings.weight")[ids]

    def block(self, i, x, batch):
        p = f"{self.root}layers.{i}."
        h = rms_norm(x, self.w(p + "norm.weight"), self.eps, dtype=self.dtype)
        kind = self.kinds[i]
        if i in self.mixers:
            h = self.mixers[i](batch, RECURRENT, i, h)
        elif kind == FULL:
            h = self.attention(p + "mixer.", i, h, batch)
        elif kind == MLP:   # no state to keep: the rows the layer goes on with only
            h = self.mlp(p + "mixer.", batch.kept(h))
        else:
            h = self.moe(p + "mixer.", batch.kept(h))
        return batch.kept(x) + h

    def attention(self, p, i, h, batch):
        N = h.shape[0]
        b = self.weights.get
        q = linear(h, self.w(p + "q_proj.weight"), b(p + "q_proj.bias")).view(N, self.heads, self.head_dim)
        k = linear(h, self.w(p + "k_proj.weight"), b(p + "k_proj.bias")).view(N, self.kv_heads, self.head_dim)
        v = linear(h, self.w(p + "v_proj.weight"), b(p + "v_proj.bias")).view(N, self.kv_heads, self.head_dim)
        a = paged_attention(batch, self.spec(i), i, q, k, v, scale=self.scale)
        return linear(a.flatten(1), self.w(p + "o_proj.weight"), b(p + "o_proj.bias"))

    def mlp(self, p, h):
        b = self.weights.get
        return linear(relu2(linear(h, self.w(p + "up_proj.weight"), b(p + "up_proj.bias"))),
                      self.w(p + "down_proj.weight"), b(p + "down_proj.bias"))

    def route(self, p, h):
        """Sigmoid scores; the top-k chosen (with the correction bias) among the best
        topk_group groups; their scores (without it), normalised, scaled."""
        gate = self.w(p + "gate.weight")  # in float32 (a packed weight multiplies in float32 as it is)
        logits = linear(h.float(), gate if is_packed(gate) else gate.float())
        scores = sigmoid(logits)
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

    def final_norm(self, x):
        return rms_norm(x, self.w(self.root + "norm_f.weight"), self.eps, dtype=self.dtype)


__all__ = ["NemotronH"]
