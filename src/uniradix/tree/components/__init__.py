"""The components a hybrid model's layers need; one per file."""
from .full import FullComponent
from .mamba import MambaComponent
from .swa import SWAComponent

__all__ = ["FullComponent", "SWAComponent", "MambaComponent"]
