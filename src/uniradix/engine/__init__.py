"""The reference engine: request lifecycle, scheduler, batching, metrics."""
from .build import build_cache
from .engine import Engine
from .request import Request, RequestMetrics, SamplingParams
from .sampling import sample

__all__ = ["Engine", "Request", "RequestMetrics", "SamplingParams", "build_cache", "sample"]
