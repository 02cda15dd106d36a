"""Workloads and reports that measure the cache from the outside (the engine's public API)."""
from .multiturn import MultiTurnWorkload, RoundReport, run_multiturn

__all__ = ["MultiTurnWorkload", "RoundReport", "run_multiturn"]
