"""Gemma 3 (text, and the text model of the multimodal 4B/12B/27B): sliding-window and
full attention layers (five to one), each with QK-norm, RoPE bases per layer kind, (1 + w)
RMSNorms before and after attention and the MLP, the embedding scaled by sqrt(hidden),
GELU-tanh MLPs, optional soft-capping.

config.json comes in three forms: the released 1B/4B/12B/27B mark the layers with
`sliding_window_pattern` (every Nth layer full) and give RoPE as `rope_theta` (full
layers), `rope_local_base_freq` (sliding layers) and `rope_scaling` (full layers only);
the 270M adds `layer_types`; today's `save_pretrained` writes `layer_types` and
`rope_parameters` nested by layer kind. The multimodal ones' text_config is sparse:
Gemma3TextConfig's defaults (below) fill it."""
from __future__ import annotations

import torch

from .config_forms import FULL, SLIDING, ConfigError, every_nth, rope_dict, rope_setup
from .family import HFModel
from .ops import gated, linear, paged_attention, rms_norm, tanh

#: Gemma3TextConfig's defaults (transformers 5.24) for the keys read here
TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": None, "use_bidirectional_attention": False,
    "tie_word_embeddings": True,
}
#: the RoPE bases where the config names none: full layers, sliding layers
THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
LEGACY_THETA = {FULL: "rope_theta", SLIDING: "rope_local_base_freq"}


class Gemma3(HFModel):
    model_types = ("gemma3_text", "gemma3")
    defaults = {"gemma3_text": TEXT_DEFAULTS, "gemma3": TEXT_DEFAULTS}
    layer_kinds = (FULL, SLIDING)
    pattern_keys = ("sliding_window_pattern",)
    partial_rotary = False

    @classmethod
    def derive_kinds(cls, c):
        kinds = every_nth(c, "sliding_window_pattern", 6, FULL, SLIDING)
        hidden = c.get("_sliding_window_pattern")  # written beside layer_types; alone, transformers reads 6
        if "sliding_window_pattern" not in c and hidden not in (None, 6):
            raise ConfigError("_sliding_window_pattern", f"{hidden} without layer_types or sliding_window_pattern: "
                                                         "transformers would read 6; give layer_types")
        return kinds

    @classmethod
    def read_rope(cls, c):
        """Per layer kind, as Gemma3TextConfig reads it: `rope_parameters` nested by kind,
        `rope_scaling` (legacy) applied to the full layers, the legacy bases (or 1M / 10k)
        where a kind's setup names none."""
        params = c.get("rope_parameters")
        if params is None:
            params = {}
        elif not isinstance(params, dict) or set(params) - {FULL, SLIDING}:
            raise ConfigError("rope_parameters", "must be nested by layer kind (full_attention, sliding_attention), "
                                                 f"got {params!r:.80}")
        out = {}
        for kind in (FULL, SLIDING):
            key = f"rope_parameters.{kind}"
            p = dict(rope_dict(params.get(kind) or {"rope_type": "default"}, key))
            if kind == FULL and c.get("rope_scaling"):
                p.update(rope_dict(c["rope_scaling"], "rope_scaling"))
                key = "rope_scaling"
            legacy = LEGACY_THETA[kind]
            p.setdefault("rope_theta", c[legacy] if legacy in c else THETA[kind])
            # transformers' YaRN reads `truncate` from the top of rope_parameters, which is
            # nested by kind here: it always truncates, whatever a kind's setup says
            p.pop("truncate", None)
            out[kind] = rope_setup(p, key, c, partial_rotary=False)
        return out

    @classmethod
    def check_config(cls, c):
        super().check_config(c)
        if c.get("use_bidirectional_attention"):
            raise ConfigError("use_bidirectional_attention", "bidirectional attention (EmbeddingGemma) is not "
                                                             "supported")
        if c.get("hidden_activation") != "gelu_pytorch_tanh":
            raise ConfigError("hidden_activation", f"{c.get('hidden_activation')!r} is not supported "
                                                   "(gelu_pytorch_tanh)")

    def __init__(self, ckpt, dtype=torch.float32) -> None:
        super().__init__(ckpt, dtype)
        c = self.config
        self.eps = c["rms_norm_eps"]
        self.scale = c["query_pre_attn_scalar"] ** -0.5
        # attn_logit_softcapping is not read: Gemma 3 replaced Gemma 2's score capping with
        # QK-norm, and transformers' Gemma3Attention never applies it
        self.final_softcap = c.get("final_logit_softcapping")

    def embed(self, ids):
        e = self.w("model.embed_tokens.weight")
        scale = torch.tensor(self.config["hidden_size"] ** 0.5).to(e.dtype)
        return e[ids] * scale

    def block(self, i, x, batch):
        p = f"model.layers.{i}."
        w = self.w
        N = x.shape[0]
        h = rms_norm(x, w(p + "input_layernorm.weight"), self.eps, 1.0, dtype=self.dtype)
        q, k, v = self.projections(h, p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj")
        q = q.view(N, self.heads, self.head_dim)
        k, v = k.view(N, self.kv_heads, self.head_dim), v.view(N, self.kv_heads, self.head_dim)
        q = rms_norm(q, w(p + "self_attn.q_norm.weight"), self.eps, 1.0)
        k = rms_norm(k, w(p + "self_attn.k_norm.weight"), self.eps, 1.0)
        q, k = batch.rotate(self.rope[i], q, k)
        a = paged_attention(batch, self.spec(i), i, q, k, v, scale=self.scale)
        a = self._proj(a.flatten(1), p + "self_attn.o_proj")
        x = rms_norm(a, w(p + "post_attention_layernorm.weight"), self.eps, 1.0, residual=batch.kept(x))
        h = rms_norm(x, w(p + "pre_feedforward_layernorm.weight"), self.eps, 1.0, dtype=self.dtype)
        g, u = self.projections(h, p + "mlp.gate_proj", p + "mlp.up_proj")
        m = linear(gated("gelu_tanh", g, u), w(p + "mlp.down_proj.weight"))
        return rms_norm(m, w(p + "post_feedforward_layernorm.weight"), self.eps, 1.0, residual=x)

    def _proj(self, h, name):
        """h @ W^T, plus the bias where the checkpoint has one (attention_bias)."""
        return linear(h, self.w(name + ".weight"), self.weights.get(name + ".bias"))

    def final_norm(self, x):
        return rms_norm(x, self.w("model.norm.weight"), self.eps, 1.0, dtype=self.dtype)

    def finish(self, logits):
        if self.final_softcap is not None:
            logits = tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @property
    def finish_keeps_order(self) -> bool:
        return self.final_softcap is None   # tanh in floating point may swap two near logits
