"""The reference hybrid model's shape: a layer pattern over F, S, M and -, and presets
that mirror real layouts at a size a laptop CPU runs.

Each letter is a layer kind: its mixer (attention, recurrent, or none) and the state it
keeps (a component spec). The model's layer list, `layer_states()`, is what decides the
cache's components and pools (components.group_layers)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..specs import (FullKV, KVShape, LayerState, ModelStates, RecurrentShape, RecurrentState,
                          SlidingWindowKV, StateSpec, group_layers)

LAYER_KINDS = {"F": "full attention", "S": "sliding-window attention", "M": "recurrent (gated delta)",
               "H": "full attention and recurrent side by side (keeps KV and a state)",
               "-": "MLP only (keeps no cache)"}
FULL = FullKV()


@dataclass(frozen=True)
class HybridConfig:
    """pattern: one letter per layer (F, S, M, H, -). Attention uses grouped-query heads
    and RoPE; S attends to the last `window` tokens; M is a short causal depthwise conv
    (kernel `conv_kernel`, its own state) feeding a per-head recurrent state of
    `state_dim` x `head_dim`, updated per token; H runs full attention and the recurrent
    mixer side by side and adds both (as Falcon-H1's hybrid layers do); - has no mixer
    (MLP only).

    `kinds` adds layer kinds: ((letter, spec), ...), an attention layer reading the KV a
    KV spec describes (a second window, say) or a recurrent layer keeping a recurrent
    spec's state; the spec is the layer's component."""

    pattern: str = "FSMF"
    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    window: int = 16
    conv_kernel: int = 4
    state_dim: int = 16
    mlp_hidden: int = 128
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"
    seed: int = 0
    kinds: tuple = ()

    def __post_init__(self) -> None:
        extra = dict(self.kinds)
        for letter, spec in extra.items():
            if letter in LAYER_KINDS or not isinstance(spec, StateSpec):
                raise ValueError(f"kinds: {letter!r} must be a new letter mapped to a component spec, got {spec!r}")
        known = set(LAYER_KINDS) | set(extra)
        bad = sorted(set(self.pattern) - known)
        if not self.pattern or bad:
            raise ValueError(f"pattern must be a non-empty string over {''.join(sorted(known))}, got {self.pattern!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "window",
                     "conv_kernel", "state_dim", "mlp_hidden"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def layers(self, kind: str) -> list[int]:
        """Indices of the layers of one kind."""
        return [i for i, k in enumerate(self.pattern) if k == kind]

    def specs(self, kind: str) -> tuple:
        """The states a layer of this kind keeps: its attention's KV spec and/or its
        recurrent mixer's state spec (none for an MLP-only layer)."""
        if kind == "F":
            return (FULL,)
        if kind == "S":
            return (SlidingWindowKV(self.window),)
        if kind == "M":
            return (RecurrentState(),)
        if kind == "H":
            return (FULL, RecurrentState())
        spec = dict(self.kinds).get(kind)
        return () if spec is None else (spec,)

    def attention(self, kind: str) -> StateSpec | None:
        """The KV spec a layer of this kind attends over (None: no attention)."""
        return next((s for s in self.specs(kind) if not s.checkpoint), None)

    def recurrent(self, kind: str) -> StateSpec | None:
        """The state spec of its recurrent mixer (None: no recurrent mixer)."""
        return next((s for s in self.specs(kind) if s.checkpoint), None)

    def layer_states(self) -> list[LayerState]:
        """What each layer keeps, in layer order: the model's layer list."""
        kv = KVShape(self.n_kv_heads, self.head_dim, self.dtype)
        rec = RecurrentShape((self.n_heads * self.head_dim, self.conv_kernel - 1),
                             (self.n_heads, self.state_dim, self.head_dim), self.dtype, self.dtype)
        return [LayerState(i, spec, rec if spec.checkpoint else kv)
                for i, kind in enumerate(self.pattern) for spec in self.specs(kind)]

    def states(self) -> ModelStates:
        """The model's components (FULL first) with the layers that keep each."""
        return group_layers(self.layer_states(), FULL)

    def with_(self, **changes) -> "HybridConfig":
        return replace(self, **changes)


PRESETS: dict[str, HybridConfig] = {
    # every kind of layer, tiny: the default
    "tiny-hybrid": HybridConfig(pattern="FSMF"),
    # Qwen3-Next: three linear-attention (recurrent) layers to one full attention layer
    "qwen3-next-like": HybridConfig(pattern="MMMF" * 2),
    # gpt-oss: sliding-window and full attention alternating
    "gpt-oss-like": HybridConfig(pattern="SF" * 3),
    # Gemma 3: five local (sliding) layers to one global
    "gemma3-like": HybridConfig(pattern="SSSSSF"),
    # Jamba: seven Mamba layers to one attention layer
    "jamba-like": HybridConfig(pattern="MMMMMMMF"),
    # single-kind references, for the benchmarks' F-only / F+S / F+M rows
    "full-only": HybridConfig(pattern="FF"),
}


def preset(name: str) -> HybridConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
