"""Recurrent (Mamba-style) layers: a state checkpoint valid at exactly one boundary."""
from ..component import CheckpointComponent


class MambaComponent(CheckpointComponent):
    name = "mamba"
