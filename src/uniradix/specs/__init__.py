"""Component specs: each kind of per-layer state, described once (`uniradix.tree`'s
components are the reuse rules; a spec makes one and says the rest).

A spec says everything the layers above the tree need to know about one kind of state:
its reuse rule (the tree component it makes), how its pool is built from the model's
layers that keep it, what a running request may free as it advances, whether it is a
per-request checkpoint, and what it is called in L3. The engine, pool building, the
forward, L2 and L3 are driven by specs and name none of them: a new kind of state is one
spec (see tests/engine/test_new_component.py, which defines one outside the package).

A model describes its layers as `LayerState`s (a spec and that layer's shape);
`group_layers` turns them into the model's components, FULL first."""
from .kv import FullKV, KVShape, SlidingWindowKV
from .recurrent import RecurrentShape, RecurrentState
from .spec import LayerState, ModelStates, StateSpec, group_layers

__all__ = ["StateSpec", "LayerState", "ModelStates", "group_layers", "FullKV", "SlidingWindowKV", "KVShape",
           "RecurrentState", "RecurrentShape"]
