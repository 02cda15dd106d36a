"""Granite-4.0-H (granitemoehybrid): Mamba2 layers and full-attention layers (no RoPE
unless position_embedding_type is "rope"), each followed by a MoE block with a shared
SwiGLU MLP; μP multipliers on the embedding, the attention scale, both residuals and the
logits.

The Mamba2 mixer lives here and Nemotron-H imports it: in_proj to (z, xBC, dt), a
depthwise causal conv over xBC (the pool keeps its last K-1 inputs), SiLU, the selective
scan with dt = clamp(softplus(dt + dt_bias)), A = -exp(A_log), a float32 state
[heads, head_dim, d_state] per request and the D skip, then the grouped RMSNorm gated by
SiLU(z) and out_proj. The scan runs token by token in the row-invariant kernel
(model/kernels), so any split of a sequence (chunked prefill, captures, a resumed
checkpoint, a decode step) reaches the same state bit for bit. Without the kernels, a
decode step advances the state one token and a longer piece runs the scan in chunks of
SCAN_CHUNK tokens in closed form (the state-space dual: within a chunk every output is a
decay-weighted sum over the chunk's inputs plus the decayed state it entered with),
equal to the token loop up to float32 rounding."""
from __future__ import annotations

import math

import torch

from ...specs import RecurrentShape
from .config_forms import FULL, LINEAR, ConfigError, layer_count
from .family import RECURRENT, HFModel
from .. import kernels
from .ops import causal_conv, exp, gated, linear, paged_attention, rms_norm_llama, run_recurrent, silu, softplus


def config_float(v, default: float | None = None) -> float | None:
    """A number from config.json; transformers writes inf as {"__float__": "Infinity"}."""
    if v is None:
        return default
    if isinstance(v, dict):
        v = v.get("__float__", default)
    return float(v)


# ---------------------------------------------------------------------------- Mamba2
#: tokens per chunk of the closed-form scan: long enough that a 256-token prefill is a few
#: batched products, short enough that the [chunk, chunk] decay matrices stay small
SCAN_CHUNK = 64


def chunked_scan(xdt: torch.Tensor, log_decay: torch.Tensor, B: torch.Tensor, C: torch.Tensor, s: torch.Tensor,
                 chunk: int = SCAN_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan s_t = exp(log_decay_t) s_{t-1} + xdt_t B_t^T, y_t = s_t C_t over
    xdt [Bn, T, H, P], log_decay [Bn, T, H], B and C [Bn, T, H, N] from s [Bn, H, P, N],
    chunk by chunk: returns (y [Bn, T, H, P], the state after the last token), all float32."""
    T = xdt.shape[1]
    y = torch.empty_like(xdt)
    for lo in range(0, T, chunk):
        hi = min(T, lo + chunk)
        cum = torch.cumsum(log_decay[:, lo:hi].transpose(1, 2), -1)  # [Bn, H, n]: log decay from lo to t
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=xdt.device).tril()
        between = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")))  # j -> t
        Bc, Cc, Xc = B[:, lo:hi], C[:, lo:hi], xdt[:, lo:hi]
        y[:, lo:hi] = torch.einsum("bhtj,bjhp->bthp", torch.einsum("bthn,bjhn->bhtj", Cc, Bc) * between, Xc) + \
            torch.einsum("bhpn,bthn->bthp", s, Cc) * torch.exp(cum).transpose(1, 2)[..., None]
        to_end = torch.exp(cum[..., -1:] - cum)  # [Bn, H, n]: decay from each token to the chunk's end
        s = s * torch.exp(cum[..., -1])[..., None, None] + torch.einsum("bjhp,bhj,bjhn->bhpn", Xc, to_end, Bc)
    return y, s


class Mamba2:
    """One Mamba2 mixer's sizes and weights (`prefix`: the mixer's module path in the
    checkpoint, e.g. "model.layers.3.mamba.")."""

    def __init__(self, model: HFModel, prefix: str, *, heads: int, head_dim: int, d_state: int, groups: int,
                 conv_kernel: int, eps: float, dt_limit: tuple, act: str = "silu") -> None:
        self.heads, self.head_dim, self.d_state, self.groups = heads, head_dim, d_state, groups
        self.inner = heads * head_dim
        self.conv_dim = self.inner + 2 * groups * d_state
        self.K = conv_kernel
        self.eps = eps
        self.dt_lo, self.dt_hi = dt_limit
        if act not in ("silu", "swish"):
            raise ValueError(f"{model.ckpt.path}: Mamba2 activation {act!r} is not supported (silu)")
        self.model, self.prefix = model, prefix
        conv_w, in_w = self.w("conv1d.weight"), self.w("in_proj.weight")
        if conv_w.shape[0] != self.conv_dim or conv_w.shape[-1] != self.K:
            raise ValueError(f"{model.ckpt.path}: {prefix}conv1d.weight is {tuple(conv_w.shape)}, the config "
                             f"gives {self.conv_dim} channels and kernel {self.K}")
        want = self.inner + self.conv_dim + heads
        if in_w.shape[0] != want:
            raise ValueError(f"{model.ckpt.path}: {prefix}in_proj has {in_w.shape[0]} rows, the config "
                             f"gives {want} (z {self.inner}, xBC {self.conv_dim}, dt {heads})")

    def w(self, name: str) -> torch.Tensor:
        """A weight of this mixer, looked up at use (the model may have moved them)."""
        return self.model.w(self.prefix + name)

    def b(self, name: str) -> torch.Tensor | None:
        return self.model.weights.get(self.prefix + name)

    def shape(self, dtype: torch.dtype) -> RecurrentShape:
        return RecurrentShape(conv_shape=(self.conv_dim, self.K - 1),
                              state_shape=(self.heads, self.head_dim, self.d_state),
                              conv_dtype=str(dtype).removeprefix("torch."), state_dtype="float32")

    def __call__(self, batch, spec, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The mixer over the batch's normed hidden states h [N, D]: returns [N, D]."""
        proj = linear(h, self.w("in_proj.weight"), self.b("in_proj.bias"))
        z = proj[:, :self.inner]
        y = run_recurrent(batch, spec, layer, proj[:, self.inner:], self.scan)
        return linear(self.gated_norm(y, batch.kept(z)).to(h.dtype), self.w("out_proj.weight"), self.b("out_proj.bias"))

    def scan(self, xbcdt: torch.Tensor, states):
        """Tokens [B, T, conv_dim + heads] of B requests from their (conv state, ssm
        state): returns (y [B, T, inner] in float32, the new states)."""
        conv_state, ssm = states
        Bn, T = xbcdt.shape[:2]
        H, P, N, G = self.heads, self.head_dim, self.d_state, self.groups
        xbc, dt = xbcdt[..., :self.conv_dim], xbcdt[..., self.conv_dim:]
        xbc, conv_state = causal_conv(xbc, conv_state, self.w("conv1d.weight").reshape(self.conv_dim, self.K),
                                      self.b("conv1d.bias"), act="silu")
        x = xbc[..., :self.inner].float().view(Bn, T, H, P)
        B = xbc[..., self.inner:self.inner + G * N].float().view(Bn, T, G, N).repeat_interleave(H // G, dim=2)
        C = xbc[..., self.inner + G * N:].float().view(Bn, T, G, N).repeat_interleave(H // G, dim=2)
        dt = softplus(dt + self.w("dt_bias").to(dt.dtype))
        dt = torch.clamp(dt, min=self.dt_lo, max=self.dt_hi).float()  # [Bn, T, H]
        A = -exp(self.w("A_log").float())
        if x.device.type == "cpu" and kernels.available():  # row-invariant, token by token, in C
            y, s = kernels.ssm_scan(x, dt, A, B, C, ssm)
            y = y + self.w("D").float()[:, None] * x
            return y.reshape(Bn, T, H * P), (conv_state, s.to(ssm.dtype))
        log_decay = dt * A  # [Bn, T, H]
        xdt = x * dt[..., None]  # [Bn, T, H, P]
        s = ssm.float()
        if T == 1:
            s = s * torch.exp(log_decay)[:, 0, :, None, None] + xdt[:, 0, :, :, None] * B[:, 0, :, None, :]
            y = (s @ C[:, 0, :, :, None]).squeeze(-1)[:, None]
        else:
            y, s = chunked_scan(xdt, log_decay, B, C, s)
        y = y + self.w("D").float()[:, None] * x
        return y.reshape(Bn, T, H * P), (conv_state, s.to(ssm.dtype))

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each group of y * SiLU(z), in float32, scaled by the weight."""
        g = y.float() * silu(z.float())
        g = g.view(g.shape[0], self.groups, g.shape[1] // self.groups)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.w("norm.weight").float() * g.flatten(1)


# ---------------------------------------------------------------------------- Granite
#: GraniteMoeHybridConfig's defaults (transformers 5.24) for the keys read here
DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0,
    "attention_multiplier": 1.0, "num_local_experts": 8, "num_experts_per_tok": 2, "position_embedding_type": None,
    "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_head": "auto", "mamba_d_conv": 4,
    "mamba_expand": 2, "time_step_limit": (0.0, math.inf), "tie_word_embeddings": False,
}


class GraniteHybrid(HFModel):
    """Config forms: the released Granite-4.0-H list `layer_types` in the legacy names
    (`mamba`, `attention`) with `position_embedding_type` "nope"; `layers_block_type` is
    the same list; with neither, every layer is Mamba2 (GraniteMoeHybridConfig)."""

    model_types = ("granitemoehybrid",)
    defaults = {"granitemoehybrid": DEFAULTS}
    layer_kinds = (LINEAR, FULL)
    kind_keys = ("layers_block_type", "layer_types")
    partial_rotary = False
    expert_stacks = HFModel.expert_stacks + ("block_sparse_moe.input_linear.weight",
                                             "block_sparse_moe.output_linear.weight")

    @classmethod
    def derive_kinds(cls, c):
        return [LINEAR] * layer_count(c)

    @classmethod
    def read_rope(cls, c):
        """RoPE only where position_embedding_type is "rope" (the released ones: "nope")."""
        return super().read_rope(c) if c["position_embedding_type"] == "rope" else {}

    @classmethod
    def check_config(cls, c):
        super().check_config(c)
        if c.get("hidden_act") not in ("silu", "swish"):
            raise ConfigError("hidden_act", f"{c.get('hidden_act')!r} is not supported (silu)")
        if c["position_embedding_type"] not in (None, "rope", "nope"):
            raise ConfigError("position_embedding_type", f"{c['position_embedding_type']!r} is not supported "
                                                         "(None, nope or rope)")

    def __init__(self, ckpt, dtype=torch.float32) -> None:
        super().__init__(ckpt, dtype)
        c = self.config
        self.eps = c["rms_norm_eps"]
        self.scale = config_float(c["attention_multiplier"], 1.0)
        self.embedding_multiplier = config_float(c["embedding_multiplier"], 1.0)
        self.residual_multiplier = config_float(c["residual_multiplier"], 1.0)
        self.logits_scaling = config_float(c["logits_scaling"], 1.0)
        self.top_k = c["num_experts_per_tok"]
        self.experts = c["num_local_experts"] or 0
        inner = int(c["mamba_expand"] * c["hidden_size"])
        heads = c["mamba_n_heads"]
        head_dim = c["mamba_d_head"]
        head_dim = inner // heads if head_dim in (None, "auto") else head_dim
        limit = c["time_step_limit"] or (0.0, math.inf)
        self.mixers = {i: Mamba2(self, f"model.layers.{i}.mamba.", heads=heads, head_dim=head_dim,
                                 d_state=c["mamba_d_state"], groups=c["mamba_n_groups"],
                                 conv_kernel=c["mamba_d_conv"], eps=self.eps,
                                 dt_limit=(config_float(limit[0], 0.0), config_float(limit[1], math.inf)))
                       for i, k in enumerate(self.kinds) if k == LINEAR}

    def recurrent_shape(self, i):
        return self.mixers[i].shape(self.dtype)

    def embed(self, ids):
        return self.w("model.embed_tokens.weight")[ids] * self.embedding_multiplier

    def attention(self, i, h, batch):
        p = f"model.layers.{i}.self_attn."
        N = h.shape[0]
        b = self.weights.get
        q = linear(h, self.w(p + "q_proj.weight"), b(p + "q_proj.bias")).view(N, self.heads, self.head_dim)
        k = linear(h, self.w(p + "k_proj.weight"), b(p + "k_proj.bias")).view(N, self.kv_heads, self.head_dim)
        v = linear(h, self.w(p + "v_proj.weight"), b(p + "v_proj.bias")).view(N, self.kv_heads, self.head_dim)
        if self.rope[i] is not None:
            q, k = batch.rotate(self.rope[i], q, k)
        a = paged_attention(batch, self.spec(i), i, q, k, v, scale=self.scale)
        return linear(a.flatten(1), self.w(p + "o_proj.weight"), b(p + "o_proj.bias"))

    def block(self, i, x, batch):
        p = f"model.layers.{i}."
        h = rms_norm_llama(x, self.w(p + "input_layernorm.weight"), self.eps, dtype=self.dtype)
        if i in self.mixers:
            h = self.mixers[i](batch, RECURRENT, i, h)
        else:
            h = self.attention(i, h, batch)
        x = batch.kept(x) + h * self.residual_multiplier
        h = rms_norm_llama(x, self.w(p + "post_attention_layernorm.weight"), self.eps, dtype=self.dtype)
        m = self.shared_mlp(p + "shared_mlp.", h)
        if self.experts > 0:
            m = self.moe(p + "block_sparse_moe.", h) + m
        return x + m * self.residual_multiplier

    def shared_mlp(self, p, h):
        gate, up = linear(h, self.w(p + "input_linear.weight")).chunk(2, dim=-1)
        return linear(gated("silu", gate, up), self.w(p + "output_linear.weight"))

    def moe(self, p, h):
        """Top-k of the router's logits, softmax over those k, SwiGLU experts."""
        router = self.weights.get(p + "router.layer.weight")
        if router is None:
            router = self.w(p + "router.weight")
        gate_up = self.weights.get(p + "input_linear.weight")
        if gate_up is None:
            gate_up = self.w(p + "experts.gate_up_proj")
        down = self.weights.get(p + "output_linear.weight")
        if down is None:
            down = self.w(p + "experts.down_proj")
        logits = linear(h, router).float()
        top, idx = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).to(h.dtype)
        out = torch.zeros_like(h)
        for e in idx.unique().tolist():
            rows, slot = torch.where(idx == e)
            gate, up = linear(h[rows], gate_up[e]).chunk(2, dim=-1)
            y = linear(gated("silu", gate, up), down[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    def final_norm(self, x):
        return rms_norm_llama(x, self.w("model.norm.weight"), self.eps, dtype=self.dtype)

    def finish(self, logits):
        return logits / self.logits_scaling

    @property
    def finish_keeps_order(self) -> bool:
        return self.logits_scaling > 0   # a correctly rounded division by a positive constant


__all__ = ["GraniteHybrid", "Mamba2", "chunked_scan", "config_float"]
