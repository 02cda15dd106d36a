"""The spec protocol, and grouping a model's layers into components."""
from __future__ import annotations

from dataclasses import dataclass


class StateSpec:
    """One kind of per-layer state (frozen dataclasses: equal specs are one component).

    `name` names the component everywhere (the tree's slot, the pool, the eviction
    keyword, the L3 key suffix); `structural` marks FULL, which shapes the tree;
    `checkpoint` marks a per-request state (one slot per request, copied on write,
    valid at exactly one boundary) rather than a handle per page."""

    name: str = "?"
    structural = False
    checkpoint = False

    def tree_component(self, keep_spare: bool = False):
        """The tree's reuse rule for this state (a fresh `tree.Component`); `keep_spare`:
        a windowed KV keeps every page an insert brings, as spares (design.md §3)."""
        raise NotImplementedError

    def pool_plan(self, layers: list, *, page_size: int, size: int, device, what: str, flags: tuple):
        """The pool of this state for `layers` (LayerStates of this spec), `size` handles,
        before it exists (a memory.PoolPlan): its cost is checked before it is built."""
        raise NotImplementedError

    def pool_size(self, cache, max_running: int, page_size: int) -> tuple[int, tuple, str, str]:
        """(handles, flags that size it, what it is in a message, its unit) from the
        cache settings: a config.CacheConfig, or the PoolSizing that engine.build passes
        (its settings, the workload the pools carry, the FULL pool's pages)."""
        raise NotImplementedError

    @property
    def l3_suffix(self) -> str | None:
        """What this state's objects add to a page key in L3 (None: the page key itself)."""
        return None if self.structural else self.name


@dataclass(frozen=True)
class PoolSizing:
    """What a spec sizes its pool from: the cache settings (`cache`, a
    config.CacheConfig: every setting is read through, `max_total_tokens` included) and
    the workload the pools must carry: `chunk` prefill tokens a step
    (--chunked-prefill-size, the whole batch's), requests of up to `context_length`
    tokens (None: not known), and `full_pages`, the FULL pool's pages once the KV budget
    is split (engine.build.plan_pools: FULL takes what the other KV pools leave of it).
    `swa_full_tokens_ratio` is the one in force: None (derived) unless given."""

    cache: object
    full_pages: int
    chunk: int
    context_length: int | None
    swa_full_tokens_ratio: float | None

    def __getattr__(self, name):
        if name == "cache":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.cache, name)


@dataclass(frozen=True)
class LayerState:
    """One layer keeps one kind of state (`spec`) with this layer's `shape` (whatever
    the spec's pool needs: KVShape, RecurrentShape). A layer that keeps two kinds (KV
    and a recurrent state) has two LayerStates; a layer that keeps nothing has none."""

    layer: int
    spec: StateSpec
    shape: object


@dataclass(frozen=True)
class ModelStates:
    """A model's components in tree order (FULL first): each spec with the layers
    that keep it. FULL is there even when no layer keeps it (it shapes the tree; its
    pool then only counts pages)."""

    groups: tuple  # ((spec, (LayerState, ...)), ...)

    @property
    def specs(self) -> list:
        return [spec for spec, _ in self.groups]

    def layers(self, name: str) -> tuple:
        return next(layers for spec, layers in self.groups if spec.name == name)

    @property
    def checkpoint(self):
        """The per-request state's spec, or None."""
        return next((s for s in self.specs if s.checkpoint), None)

    @property
    def layer_ids(self) -> list[int]:
        """Every layer that keeps any state, in compute order."""
        return sorted({ls.layer for _, layers in self.groups for ls in layers})


def group_layers(layer_states, structural) -> ModelStates:
    """Group LayerStates by spec (equal specs share a component), `structural` (the
    FULL spec) first, the others in order of first use. Two different specs with one
    name, or several checkpoint kinds, are refused: names key pools, tree slots and L3
    objects, and a request carries one recurrent state."""
    order: dict = {structural: []}
    for ls in layer_states:
        order.setdefault(ls.spec, []).append(ls)
    names: dict = {}
    for spec in order:
        other = names.setdefault(spec.name, spec)
        if other != spec:
            raise ValueError(f"two kinds of state are both named {spec.name!r} ({other} and {spec}): "
                             f"give each spec its own name")
    ckpt = [s for s in order if s.checkpoint]
    if len(ckpt) > 1:
        raise ValueError(f"one per-request state at most (layers of one request share one slot): {ckpt}")
    return ModelStates(tuple((spec, tuple(layers)) for spec, layers in order.items()))
