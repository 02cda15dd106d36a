"""What every Hugging Face family shares: the reading of its config.json (defaults,
legacy keys, layer kinds, windows and RoPE per layer: config_forms), the check at load
that config.json describes the weights (expected_shapes), the layer list
(which states each layer keeps, so the cache's components and pools), the forward
skeleton (embed, one block per layer, final norm, head) over a Batch, and a no-cache
oracle that runs the same forward over scratch pools. A family states how its config
class reads config.json and writes `embed`, `block` and `head` (and the states its
recurrent layers keep)."""
from __future__ import annotations

import json
import math
import struct

import torch

from ...specs import FullKV, KVShape, LayerState, RecurrentState, SlidingWindowKV, group_layers
from .. import kernels
from ..base import PagedModel
from ..paged import head_rows
from .checkpoint import Checkpoint
from .config_forms import FULL, HYBRID, LINEAR, SLIDING, ConfigError, Layer, config_source, layer_count, \
    listed_kinds, single_rope, with_defaults
from .ops import Batch, linear, rope_inv_freq
from .weights_forms import HFWeights

FULL_KV = FullKV()
RECURRENT = RecurrentState()
#: the keys the families mark their layers with, beside the lists
LAYER_MARKERS = ("layer_types", "layers_block_type", "sliding_window_pattern", "full_attention_interval",
                 "hybrid_override_pattern", "attn_layer_indices", "attn_layer_period", "attn_layer_offset")
#: where a config states its context, first found wins (transformers' name first)
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
#: the head size (vocabulary x inputs) from which greedy rows take the greedy head
GREEDY_HEAD_MIN = 1 << 22


def greedy_head_pays(head) -> bool:
    """Whether the greedy head is worth building for this head here: large enough, and
    int8 dot products (AVX512-VNNI) to read its int8 copy at the memory's speed (it
    gives the same tokens either way)."""
    return (head.out_features * head.in_features >= GREEDY_HEAD_MIN and kernels.available()
            and "vnni" in kernels.lib().ur_isa().decode())


def _as_float32(x):
    """Every float in nested dicts and lists rounded to float32, as the forward adds it
    to float32 tensors (a GGUF stores rms_norm_eps 1e-6 as 9.99999997e-07: one value)."""
    if isinstance(x, float):
        return struct.unpack("<f", struct.pack("<f", x))[0] if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _as_float32(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_as_float32(v) for v in x]
    return x


class HFModel(HFWeights, PagedModel):
    """A model loaded from a checkpoint. Subclasses set `model_types` (the config's
    model_type values they serve), say how their transformers config class reads
    config.json (the class attributes and hooks below: `read_config` puts them together)
    and write embed / block / head; `recurrent_shape(i)` for families with recurrent
    layers."""

    model_types: tuple = ()
    #: per model_type: the config class's defaults for every key the family reads (a
    #: multimodal wrapper's text_config is sparse and relies on them)
    defaults: dict = {}
    #: legacy key -> current key (the legacy key wins where present, as the classes read it)
    aliases: dict = {}
    #: keys of `defaults` that config.json may give as null, meaning what the class makes of
    #: it (no window, no bidirectional attention); any other null is refused at load
    nullable: tuple = ("sliding_window", "use_bidirectional_attention")
    #: the layer kinds the forward implements
    layer_kinds: tuple = (FULL,)
    #: the keys that list the layer kinds, the one transformers prefers first
    kind_keys: tuple = ("layer_types",)
    #: the keys derive_kinds reads (where no list is given)
    pattern_keys: tuple = ()
    #: RoPE: the base where the config names none; the partial rotary factor where the config
    #: names none (None: the whole head); False where the forward always rotates the whole head
    rope_theta_default: float = 10_000.0
    partial_rotary_default: float | None = None
    partial_rotary: bool = True

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype = torch.float32) -> None:
        self.ckpt = ckpt
        try:
            self.config, self.layers = self.read_config(ckpt.config)
        except ConfigError as e:
            raise ConfigError(e.key, e.why, config_source(ckpt.path)) from None
        self.kinds = [layer.kind for layer in self.layers]
        self.dtype = dtype
        # the residual stream (the hidden states between blocks, which every block adds
        # to) in float32 under float16: its sums outgrow float16's 65504 (Gemma 3 270M
        # reaches 1e5 by its 8th layer, where transformers' float16 forward gives inf);
        # each block still computes in float16 from its normed input
        self.residual_dtype = torch.float32 if dtype == torch.float16 else dtype
        self.quantization = "none"  # quantize() says otherwise
        self.weights = ckpt.tensors
        self.files = ckpt.files
        self.tokenizer = ckpt.tokenizer
        self.eos_token_ids = ckpt.eos_token_ids()
        self.name = ckpt.model_type
        # the attention shape, read once for the KV pools and the forward
        self.heads, self.kv_heads, self.head_dim = self.attention_shape(self.config)
        self.rope = self._rope_tables()
        self.check_weights()

    #: keys of `defaults` that decide nothing the cache stores: the context (the layers'
    #: RoPE setups carry what it derives), and what the tensors' own shapes and names say
    not_computation: tuple = ("max_position_embeddings", "tie_word_embeddings", "vocab_size")

    def computation(self) -> dict:
        """The family, the precision, each layer's kind, window and RoPE, and every other
        key the family reads (`defaults`), as read: one model in two layouts (config.json
        with safetensors, a GGUF's metadata) gives the same, another window, norm epsilon
        or query scale does not."""
        keys = sorted({k for table in self.defaults.values() for k in table} - set(self.not_computation))
        return _as_float32({"family": type(self).__name__, "dtype": str(self.dtype),
                            "residual": str(self.residual_dtype), "quantization": self.quantization,
                            "layers": [[lay.kind, lay.window, lay.rope] for lay in self.layers],
                            "config": {k: self.config.get(k) for k in keys}})

    # ------------------------------------------------------------------ config.json
    @classmethod
    def read_config(cls, raw: dict) -> tuple[dict, list[Layer]]:
        """config.json (the text part of a multimodal one) as this family's config class
        reads it: the config with defaults filled in, and one Layer per layer. Raises
        ConfigError, naming the key, for what the forward cannot express."""
        c = with_defaults(raw, cls.defaults.get(raw.get("model_type"), {}), cls.aliases, cls.nullable)
        cls.check_config(c)
        kinds, key = cls.read_kinds(c)
        for i, kind in enumerate(kinds):
            if kind not in cls.layer_kinds:
                raise ConfigError(key, f"layer {i} is {kind!r}; {cls.__name__} has {', '.join(cls.layer_kinds)} layers")
        rope = cls.read_rope(c)
        return c, [Layer(k, cls.read_window(c, i, k), rope.get(k)) for i, k in enumerate(kinds)]

    @classmethod
    def read_kinds(cls, c: dict) -> tuple[list[str], str]:
        """The layer kinds and the key they come from: listed (`kind_keys`), else derived."""
        listed = listed_kinds(c, cls.kind_keys)
        if listed is None:
            cls.check_foreign_markers(c)
            return cls.derive_kinds(c), (cls.pattern_keys or cls.kind_keys)[0]
        kinds, key = listed
        if len(kinds) != layer_count(c):
            raise ConfigError(key, f"lists {len(kinds)} layers, num_hidden_layers is {c['num_hidden_layers']}")
        return kinds, key

    @classmethod
    def check_foreign_markers(cls, c: dict) -> None:
        """Where the kinds are derived: a layer marker another family reads (every
        `attn_layer_indices` Bamba lists, say) is not silently ignored, as this family's
        config class would ignore it: the config means layers this reading would not give."""
        for key in LAYER_MARKERS:
            if key not in cls.kind_keys and key not in cls.pattern_keys and c.get(key) is not None:
                raise ConfigError(key, f"{cls.__name__} does not read it; give the layers as "
                                       f"{cls.kind_keys[0]}")

    @classmethod
    def derive_kinds(cls, c: dict) -> list[str]:
        """The kinds where the config lists none (the config class's own rule)."""
        return [FULL] * layer_count(c)

    @classmethod
    def read_window(cls, c: dict, i: int, kind: str) -> int | None:
        """Layer i's sliding window (keys a query reads, itself included); None if it has none."""
        if kind != SLIDING:
            return None
        w = c.get("sliding_window")
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ConfigError("sliding_window", f"layer {i} is sliding_attention, so the window must be a "
                                                f"positive integer, got {w!r}")
        return w

    @classmethod
    def read_rope(cls, c: dict) -> dict:
        """{layer kind: its RoPE setup, or None}: by default one setup for every attention layer."""
        rope = single_rope(c, cls.rope_theta_default, cls.partial_rotary_default,
                           partial_rotary=cls.partial_rotary)
        return {FULL: rope, SLIDING: rope, HYBRID: rope}

    @classmethod
    def check_config(cls, c: dict) -> None:
        """Refuse settings the forward would otherwise ignore (ConfigError, naming the key)."""
        if c.get("is_causal") is False:
            raise ConfigError("is_causal", "bidirectional attention is not supported (a causal LM only)")

    @staticmethod
    def attention_shape(c: dict) -> tuple[int, int, int]:
        """(query heads, KV heads, head dim) of a config read by read_config."""
        heads = c["num_attention_heads"]
        return heads, c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads

    def _rope_tables(self) -> list:
        """Per layer: (inverse frequencies, attention scaling) of its RoPE, or None; one
        table per distinct setup."""
        tables: dict = {}
        out = []
        for layer in self.layers:
            if layer.rope is None:
                out.append(None)
                continue
            key = json.dumps(layer.rope, sort_keys=True, default=repr)
            if key not in tables:
                tables[key] = rope_inv_freq(layer.rope, self.head_dim, self.config.get("max_position_embeddings"))
            out.append(tables[key])
        return out

    # ------------------------------------------------------------------ the layer list
    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def context_length(self) -> int | None:
        """`max_position_embeddings` of the config (a GGUF's `<arch>.context_length` is
        read into it), or the older names some configs use; None if none is given."""
        for key in CONTEXT_KEYS:
            v = self.config.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return None

    def kv_shape(self, i: int) -> KVShape:
        return KVShape(self.kv_heads, self.head_dim, str(self.dtype).removeprefix("torch."))

    def recurrent_shape(self, i: int):
        raise NotImplementedError(f"{self.name} has no recurrent layers")

    def window(self, i: int) -> int | None:
        """The sliding window of layer i (keys a query reads, itself included)."""
        return self.layers[i].window

    def layer_states(self) -> list[LayerState]:
        out = []
        for i, kind in enumerate(self.kinds):
            if kind in (FULL, HYBRID):
                out.append(LayerState(i, FULL_KV, self.kv_shape(i)))
            if kind == SLIDING:
                out.append(LayerState(i, SlidingWindowKV(self.window(i)), self.kv_shape(i)))
            if kind in (LINEAR, HYBRID):
                out.append(LayerState(i, RECURRENT, self.recurrent_shape(i)))
        return out

    def states(self):
        return group_layers(self.layer_states(), FULL_KV)

    def spec(self, i: int):
        """The KV spec layer i attends over (None: it has no attention)."""
        kind = self.kinds[i]
        if kind in (FULL, HYBRID):
            return FULL_KV
        if kind == SLIDING:
            return SlidingWindowKV(self.window(i))
        return None

    # ------------------------------------------------------------------ the forward
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def block(self, i: int, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Layer i over the batch's hidden states x [N, D]: attention through
        ops.paged_attention, recurrent mixers through ops.run_recurrent."""
        raise NotImplementedError

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm over the rows x [n, D] that get logits, in the model's dtype."""
        raise NotImplementedError

    def finish(self, logits: torch.Tensor) -> torch.Tensor:
        """What the family does to the head's products (a scaling, a soft cap): none here."""
        return logits

    #: whether `finish` keeps the order of any two logits (never puts a smaller one above
    #: a larger), so that the greedy head may pick the argmax from a few exact words
    finish_keeps_order = True

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head over the rows x [n, D] that get logits (row by row:
        the forward hands it only the rows it samples)."""
        return self.finish(linear(self.final_norm(x), self.tied_head()))

    def greedy_head(self) -> kernels.GreedyHead | None:
        """The head's int8 bound for greedy rows (kernels.GreedyHead: the same argmax from
        half a bfloat16 head's bytes, a quarter of a float32 one's), built on first use
        where it pays (greedy_head_pays) and the finish keeps the order; else None (the
        full head; also while the kernels are switched off, kernels.off)."""
        if not kernels.available():
            return None
        head = self.tied_head()
        if self._greedy_for is not head:   # first use, or the head changed (moved, quantized)
            self._greedy = (kernels.GreedyHead(head) if isinstance(head, kernels.PackedWeight)
                            and self.finish_keeps_order and greedy_head_pays(head) else False)
            self._greedy_for = head
        return self._greedy or None

    _greedy = None
    _greedy_for = None

    @torch.no_grad()
    def forward(self, pools, inputs, wait_layer=None):
        """Logits [n_logits, vocab] per request: the head runs only on each request's
        last `logit_rows` rows (PagedInput). The last layer writes what the cache keeps of
        every row (its KV, its recurrent state) and computes the rest (attention, output
        projection, MLP) for those rows only (Batch.keep): a prefill chunk's other rows
        end there."""
        if not inputs:
            return []
        device = next(iter(self.weights.values())).device
        batch = Batch(pools, inputs, device)
        rows, counts = head_rows(inputs, device)  # checked before any pool is written
        x = self.embed(batch.ids).to(self.residual_dtype)
        for i in range(len(self.kinds)):
            if wait_layer is not None:
                wait_layer(i)
            if i == len(self.kinds) - 1:
                batch.keep = rows
            x = self.block(i, x, batch)
        out = self._outputs(x, inputs, counts)
        batch.commit()  # only now does any request's recurrent state advance
        return out

    def _outputs(self, x: torch.Tensor, inputs, counts: list[int]) -> list[torch.Tensor]:
        """Each input's logits [n, vocab], or, for an input marked `greedy` where the
        greedy head runs, its rows' argmax tokens [n] (int64: what sampling would pick)."""
        greedy = self.greedy_head() if any(i.greedy and n for i, n in zip(inputs, counts)) else None
        if greedy is None:
            return list(self.head(x).float().split(counts))
        parts = list(x.split(counts))
        out: list = [None] * len(inputs)
        picks = [i for i, inp in enumerate(inputs) if inp.greedy and counts[i]]
        picked = torch.cat([parts[i] for i in picks])
        tokens = greedy.argmax(self.final_norm(picked), self.finish)
        full = [r for r, t in enumerate(tokens) if t is None]
        if full:   # rows the bound left undecided: the full head's argmax
            for r, row in zip(full, self.head(picked.index_select(0, torch.as_tensor(full))).float()):
                tokens[r] = kernels.argmax(row.contiguous())
        at = 0
        for i in picks:
            out[i] = torch.as_tensor(tokens[at:at + counts[i]], dtype=torch.int64)
            at += counts[i]
        rest = [i for i in range(len(inputs)) if out[i] is None]
        if rest:
            logits = self.head(torch.cat([parts[i] for i in rest])).float().split([counts[i] for i in rest])
            for i, lg in zip(rest, logits):
                out[i] = lg
        return out

    @torch.no_grad()
    def reference(self, tokens) -> torch.Tensor:
        """The same forward over scratch pools holding just these tokens (each spec's own
        pool, built from below: the model knows nothing of the engine)."""
        from ..paged import PagedInput
        tokens = list(tokens)
        device = next(iter(self.weights.values())).device
        pools, pages, slot = {}, {}, None
        for spec, layers in self.states().groups:
            recurrent = spec.checkpoint  # a state a slot, not pages
            pool = spec.pool_plan(list(layers), page_size=1, size=2 if recurrent else len(tokens) + 1,
                                  device=device, what="the reference forward's scratch", flags=()).build()
            pools[spec.name] = pool
            if recurrent:
                slot = pool.alloc(1)[0]
                pool.zero_slots([slot])
            else:
                pages[spec.name] = pool.alloc(len(tokens))
        return self.forward(pools, [PagedInput(tokens, 0, pages, slot)])[0]
